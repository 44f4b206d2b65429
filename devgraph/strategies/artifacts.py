"""Warm restarts: compiled artifacts kept on disk between processes, checked before they are used.

A compiling strategy (``full`` or ``tc_piecewise`` with a compiler) given ``cache_dir`` loads the
artifacts of an earlier process before its first compile and saves them after capture, through torch's
own cache-artifact API (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``: inductor's FX
graph cache, AOTAutograd cache and autotuning results). Where the forward could be compiled ahead of time
(``full``'s dynamic compile of an ``nn.Module``'s forward on a torch that supports it,
:mod:`devgraph.strategies.precompile`) the file also holds that compiled function, guards included: a
later process loads it and neither dynamo nor inductor runs. Otherwise dynamo still traces the forward and
inductor's code generation, the expensive part, is skipped.

The file's name holds the forward's name and a digest of the model's parameter shapes and the static
inputs, so two models of one class (a target and its draft) or two phases sharing a ``cache_dir`` keep
files of their own.

Each file carries a header with a *fingerprint* (torch, triton and devgraph versions, the device, the
strategy and compiler options, the forward's code, the model's parameter shapes and dtypes, the static
inputs and the keys) and a SHA-256 of its payload. The forward's code is followed to what it calls: the
functions and classes it names through its globals and closures (module-level helpers, the functions of a
user module it imports, ``functools.partial``, decorated functions), the methods of every module class in
the model, transitively up to :data:`MAX_CALL_DEPTH` calls deep and :data:`MAX_FUNCTIONS` functions, and
the simple constants (numbers, strings, tuples) it reads from globals and closures. Not followed: torch's,
devgraph's, triton's and the standard library's code (their versions are in the fingerprint, and dynamo
rewrites some of torch's functions as a process compiles), code reached without a name in the code
(functions kept in a dict or a list, ``getattr`` with a computed name, callables held by objects other than
modules), and compiled extensions. A file whose fingerprint differs (the model or the
sizes changed: *stale*) or whose payload does not match its hash or does not load (*corrupt*) is never
used; it is rebuilt by this process. The outcome is in ``inspect()`` (``artifact_cache``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from devgraph._version import __version__
from devgraph.errors import ConfigError

__all__ = ["ArtifactCache", "carry_triton_entries", "fingerprint", "keep_triton_kernels"]

logger = logging.getLogger(__name__)

_MAGIC = b"devgraph-compile-cache\n"
_FORMAT = 1


#: Modules whose code the digest does not follow: torch's (covered by its version; dynamo rewrites some of
#: its functions at a process's first compile, so hashing them would make the digest depend on what the
#: process compiled before), devgraph's and triton's (their versions), and Python's standard library.
_NOT_FOLLOWED = frozenset({"torch", "devgraph", "triton", "builtins", "typing", *sys.stdlib_module_names})
#: Bounds of the walk through what the forward calls: how many calls deep, and how many functions at most.
MAX_CALL_DEPTH = 8
MAX_FUNCTIONS = 4000
#: A global constant's ``repr`` longer than this is hashed by its type and length only.
_MAX_CONSTANT_REPR = 512


def _followed(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", None) or ""
    return isinstance(module, str) and module.split(".")[0] not in _NOT_FOLLOWED


class _CodeWalk:
    """Hashes the code the forward can run: its own, and what it reaches by name (module-level helpers,
    closures, classes and their methods, functions of imported modules, ``functools.partial`` and
    decorated functions' ``__wrapped__``), transitively, bounded by :data:`MAX_CALL_DEPTH` and
    :data:`MAX_FUNCTIONS`; and the values of the simple constants it reads from globals and closures."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self._codes: set[int] = set()
        self._objects: set[int] = set()
        self.functions = 0
        self.truncated = False

    def function(self, fn: Any, depth: int = 0) -> None:
        while True:  # decorators (functools.wraps), bound methods, static and class methods
            if isinstance(fn, (staticmethod, classmethod, types.MethodType)):
                fn = fn.__func__
            elif isinstance(fn, functools.partial):
                self._constant("partial", fn.args)
                fn = fn.func
            elif isinstance(getattr(fn, "__wrapped__", None), types.FunctionType):
                self.function(fn.__wrapped__, depth)
                break
            else:
                break
        if not isinstance(fn, types.FunctionType) or not _followed(fn) or id(fn) in self._objects:
            return
        if self.functions >= MAX_FUNCTIONS:
            self.truncated = True
            return
        self._objects.add(id(fn))
        self.functions += 1
        names: set[str] = set()
        self.code(fn.__code__, names)
        self._constant("defaults", fn.__defaults__)
        self._constant("kwdefaults", sorted((fn.__kwdefaults__ or {}).items()))
        if depth >= MAX_CALL_DEPTH:
            self.truncated = True
            return
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
            try:
                self.value(name, cell.cell_contents, names, depth + 1)
            except ValueError:  # an empty cell
                continue
        scope = fn.__globals__
        for name in sorted(names):
            if name in scope:
                self.value(name, scope[name], names, depth + 1)

    def code(self, code: Any, names: set[str]) -> None:
        if id(code) in self._codes:
            return
        self._codes.add(id(code))
        self.digest.update(code.co_code)
        self.digest.update(repr(code.co_names).encode())
        names.update(code.co_names)
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                self.code(const, names)
            elif isinstance(const, frozenset):  # its repr's order follows string hashing, per process
                self.digest.update(repr(sorted(map(repr, const))).encode())
            else:
                self.digest.update(repr(const).encode())

    def value(self, name: str, value: Any, names: set[str], depth: int) -> None:
        if isinstance(value, type):
            self.klass(value, depth)
        elif isinstance(value, types.ModuleType):
            if _followed(value) and id(value) not in self._objects:
                self._objects.add(id(value))
                for attr in sorted(names):  # module.helper(...): the attributes this code names
                    member = getattr(value, attr, None)
                    if member is not None and not isinstance(member, types.ModuleType):
                        self.value(attr, member, names, depth)
        elif callable(value):
            self.function(value, depth)
        else:
            self._constant(name, value)

    def klass(self, klass: type, depth: int) -> None:
        for base in klass.__mro__:
            if not _followed(base) or id(base) in self._objects:
                continue
            self._objects.add(id(base))
            for attr in vars(base).values():
                if isinstance(attr, (types.FunctionType, staticmethod, classmethod, property)):
                    for fn in (attr.fget, attr.fset) if isinstance(attr, property) else (attr,):
                        if fn is not None:
                            self.function(fn, depth)

    def _constant(self, name: str, value: Any) -> None:
        if not isinstance(value, (bool, int, float, complex, str, bytes, tuple, list, type(None))):
            return  # tensors, objects: their values are not code (the guard and the model digest see some)
        text = repr(value)
        if len(text) > _MAX_CONSTANT_REPR:
            text = f"{type(value).__name__}:{len(text)}"
        self.digest.update(f"{name}={text}".encode())


def _code_digest(fn: Callable[..., Any]) -> str:
    """A hash of the code ``fn`` runs: its bytecode and constants, what it reaches by name (see
    :class:`_CodeWalk`), and, for a bound method of an ``nn.Module``, every method of every module class in
    the model and what those reach."""
    walk = _CodeWalk()
    walk.function(fn)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        for module in owner.modules():
            walk.klass(type(module), 0)
    if walk.truncated:
        logger.debug("devgraph: the code digest stopped at its bounds (%d functions)", walk.functions)
    return walk.digest.hexdigest()


def _model_digest(fn: Callable[..., Any]) -> str:
    owner = getattr(fn, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return ""
    parts = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in owner.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in owner.named_buffers()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _device_name(device_type: str) -> str:
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} sm_{major}{minor}"
    return device_type


def fingerprint(
    forward: Callable[..., Any],
    device_type: str,
    options: dict[str, Any],
    inputs: Iterable[str],
    keys: Iterable[str],
) -> dict[str, Any]:
    """Everything that, if it changed, makes compiled artifacts invalid for this runner."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None

    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "devgraph": __version__,
        "device": _device_name(device_type),
        "options": options,
        "forward": getattr(forward, "__qualname__", repr(forward)),
        "code": _code_digest(forward),
        "model": _model_digest(forward),
        "inputs": sorted(inputs),
        "keys": sorted(keys),
    }


def keep_triton_kernels(cache_dir: str) -> str:
    """Where Triton keeps compiled kernels: ``cache_dir/triton`` unless ``TRITON_CACHE_DIR`` is set already.

    torch's cache artifacts carry inductor's own kernels, but not the Triton kernels a model launches itself
    (the reference model's paged attention), which every fresh machine or container would compile again at
    its first warm-up. With ``cache_dir`` on a volume that outlives the process, they are kept there too.

    A runner is built after its model, and a model may have built kernels already (the reference model's
    set-up thread builds its decode kernels, and Triton's launchers for them, while its weights load) into
    the cache Triton used until now. Those entries, the ones this process wrote, are copied along
    (:func:`carry_triton_entries`): Triton looks a launcher up in the cache it uses at the first launch, and
    would otherwise build each one again there, a fifth of a second apiece on Triton 3.6.
    """
    chosen = os.environ.get("TRITON_CACHE_DIR")
    if chosen:
        return chosen
    path = str(Path(cache_dir).expanduser().resolve() / "triton")
    before = _triton_cache_in_use()
    os.environ["TRITON_CACHE_DIR"] = path
    if before is not None and Path(before).resolve() != Path(path):
        carried = carry_triton_entries(Path(before), Path(path), since=_process_started())
        if carried:
            logger.info(
                "%d Triton cache entries this process built copied from %s to %s", carried, before, path
            )
    return path


def _triton_cache_in_use() -> str | None:
    """The directory Triton writes its cache to now (``None`` without triton)."""
    try:
        from triton import knobs
    except ImportError:  # no triton, or one older than its knobs: nothing to carry
        return None
    return str(knobs.cache.dir)


def _process_started() -> float:
    """When this process started, in wall-clock seconds (Linux's ``/proc``); infinity where unknown, so
    nothing is taken for this process's own."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        with open("/proc/stat") as stat:
            boot = next(float(line.split()[1]) for line in stat if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") - 1.0  # btime is whole seconds
    except (OSError, ValueError, IndexError, StopIteration):
        return float("inf")


def carry_triton_entries(source: Path, target: Path, *, since: float, most: int = 512) -> int:
    """Copy the entries of Triton's cache ``source`` written since ``since`` (this process's: a kernel and
    its metadata, or a launcher, one directory each, named by their hash) into ``target``, keeping any
    already there; at most ``most``. A kernel's group file (``__grp__*.json``) names its files by absolute
    path: the copy's names its own files, so it outlives ``source``. Each entry is staged, then renamed
    into place (Triton never sees half a copy; an entry Triton was still writing may be copied without
    its group file, and is then built again, as before); links are copied as links, never followed. An
    entry that fails is skipped and logged at DEBUG; nothing here raises. Returns how many were copied."""
    try:
        entries = list(os.scandir(source))
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.debug("Triton's cache entries in %s not carried to %s: %r", source, target, exc)
        return 0
    fresh = []
    for entry in entries:
        try:
            mine = entry.is_dir(follow_symlinks=False) and not entry.name.startswith(".")
            if mine and entry.stat(follow_symlinks=False).st_mtime >= since:
                fresh.append(entry)
        except OSError:  # gone since the listing
            continue
    copied = 0
    for entry in sorted(fresh, key=lambda e: e.name)[:most]:
        destination = target / entry.name
        if destination.exists():
            continue
        staging: Path | None = None
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=target))
            shutil.copytree(entry.path, staging, symlinks=True, dirs_exist_ok=True)
            _repoint_groups(staging, Path(entry.path), destination)
            staging.rename(destination)
            staging = None
            copied += 1
        except Exception as exc:  # a vanished file, a bad group file, another process first: skip it
            logger.debug("Triton's cache entry %s not carried: %r", entry.path, exc)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
    return copied


def _repoint_groups(entry: Path, old: Path, new: Path) -> None:
    """Rewrite the group files of a copied entry: the paths of its files under ``old`` name ``new``."""
    for group in entry.glob("__grp__*.json"):
        data = json.loads(group.read_text())
        children = data.get("child_paths") if isinstance(data, dict) else None
        if not isinstance(children, dict):
            continue
        for name, path in children.items():
            if isinstance(path, str) and Path(path).parent == old:
                children[name] = str(new / Path(path).name)
        group.write_text(json.dumps(data))


def _split(blob: bytes) -> tuple[dict[str, Any], bytes] | None:
    """A file's header and payload (``_MAGIC``, one line of JSON, the payload), or ``None`` where the
    file is not one."""
    if not blob.startswith(_MAGIC):
        return None
    header_end = blob.find(b"\n", len(_MAGIC))
    if header_end < 0:
        return None
    try:
        header = json.loads(blob[len(_MAGIC) : header_end])
    except ValueError:
        return None
    return (header, blob[header_end + 1 :]) if isinstance(header, dict) else None


class ArtifactCache:
    """One file of compiled artifacts for one runner's forward in ``directory``."""

    def __init__(self, directory: str, forward: Callable[..., Any], print_: dict[str, Any]) -> None:
        if not isinstance(directory, str) or not directory:
            raise ConfigError(f"cache_dir must be a directory path, got {directory!r}")
        name = getattr(forward, "__qualname__", "forward").replace("<", "").replace(">", "")
        options = print_["options"]
        suffix = f"{options['strategy']}-{options['compiler']}.dgcache"
        # What this runner is (which model, which inputs) names the file; what it was built with (torch,
        # the code, the keys) is checked inside it, so a change there is found stale and rebuilt in place.
        identity = json.dumps([print_.get("model"), print_.get("inputs")], default=str)
        ident = hashlib.sha256(identity.encode()).hexdigest()[:12]
        self.path = Path(directory).expanduser() / f"{name}-{ident}.{suffix}"
        self.forward = forward
        #: Load the ahead-of-time compiled function when the file has one (set by the compile session).
        self.precompile = False
        #: The ahead-of-time compiled function the file held, once loaded.
        self.precompiled: Any = None
        self.saved_precompiled = False
        self.fingerprint = print_
        self._key = hashlib.sha256(json.dumps(print_, sort_keys=True, default=str).encode()).hexdigest()
        self.status = "unused"  # hit | miss | stale | corrupt | saved | unused
        self.loaded = "unused"  # the outcome of load(), kept after a save
        #: Per key name, the compiled-or-plain choice of the process that wrote the file (``full`` with a
        #: compiler, :class:`~devgraph.strategies.choice.CompileChoice`); loaded with a hit only.
        self.choices: dict[str, dict[str, Any]] = {}
        #: The choices the file holds as this process last loaded (a hit) or wrote it.
        self.choices_in_file: dict[str, dict[str, Any]] = {}

    def load(self) -> str:
        """Load the artifacts if the file matches this runner; returns and records the outcome."""
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            self.status = self.loaded = "miss"
            return self.status
        except OSError as exc:
            logger.warning(
                "devgraph: cannot read compile cache %s (%s); compiling from scratch", self.path, exc
            )
            self.status = self.loaded = "corrupt"
            return self.status
        self.status = self.loaded = self._load_blob(blob)
        if self.status != "hit":
            self.choices = {}
            logger.warning(
                "devgraph: compile cache %s is %s; it is not used and will be rebuilt", self.path, self.status
            )
        self.choices_in_file = dict(self.choices)
        return self.status

    def _load_blob(self, blob: bytes) -> str:
        parts = _split(blob)
        if parts is None:
            return "corrupt"
        header, payload = parts
        if header.get("format") != _FORMAT:
            return "corrupt"
        if header.get("key") != self._key:
            return "stale"
        if header.get("sha256") != hashlib.sha256(payload).hexdigest() or header.get("bytes") != len(payload):
            return "corrupt"
        tail = header.get("precompiled_bytes", 0)
        if not isinstance(tail, int) or not 0 <= tail <= len(payload):
            return "corrupt"
        traced, precompiled = payload[: len(payload) - tail], payload[len(payload) - tail :]
        choices = header.get("choices", {})
        self.choices = choices if isinstance(choices, dict) else {}
        if tail and self.precompile:
            from devgraph.strategies.precompile import deserialize

            try:
                # torch's cache artifacts first: they put the compiled kernels (Triton's binaries) into the
                # caches the precompiled function's kernels are loaded through, so none is built again.
                if traced and torch.compiler.load_cache_artifacts(traced) is None:
                    return "corrupt"
                self.precompiled = deserialize(precompiled, self.forward)
            except Exception as exc:  # a payload torch cannot rebuild (another build, a damaged file)
                logger.debug("loading the precompiled forward failed: %s", exc)
                return "corrupt"
            return "hit"
        payload = traced
        if not payload:
            # Only choices: a hit for a compiler that leaves no artifacts (``eager``). For one that does,
            # the compiled code is not here (torch had none to save): stale, so that it is saved once it
            # can be. Only a precompiled function, which this process cannot use: stale.
            leaves_none = self.fingerprint.get("options", {}).get("compiler") == "eager"
            return "hit" if self.choices and not tail and leaves_none else "stale"
        try:
            loaded = torch.compiler.load_cache_artifacts(payload)
        except Exception as exc:  # torch rejected the payload (another build, a truncated write)
            logger.debug("load_cache_artifacts failed: %s", exc)
            return "corrupt"
        # torch logs and returns None, rather than raising, when it cannot read the payload.
        return "hit" if loaded is not None else "corrupt"

    def save(self, precompiled: bytes = b"", choices: dict[str, dict[str, Any]] | None = None) -> None:
        """Write this process's compiled artifacts and, when given, the ahead-of-time compiled forward and
        the compiled-or-plain choice per key (atomically: a reader never sees half a file)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None and not precompiled and not choices:
            return
        payload = (saved[0] if saved is not None else b"") + precompiled
        header = {
            "format": _FORMAT,
            "key": self._key,
            "sha256": hashlib.sha256(payload).hexdigest(),
            "bytes": len(payload),
            "precompiled_bytes": len(precompiled),
            "fingerprint": self.fingerprint,
            "choices": choices or {},
        }
        self._write(header, payload)
        self.status = "saved" if self.status != "hit" else "hit"
        self.choices_in_file = dict(choices or {})
        if precompiled:
            self.saved_precompiled = True

    def add_choices(self, choices: dict[str, dict[str, Any]]) -> None:
        """Add the choices of keys captured after the file was loaded or written (a lazy runner captures
        each key in a session of its own) to the file's header; the payload is copied as it is (this
        process's cache artifacts may not hold what it loaded). Nothing when no choice is new, or when the
        file is no longer this runner's."""
        merged = {**self.choices_in_file, **choices}
        if merged == self.choices_in_file:
            return
        try:
            parts = _split(self.path.read_bytes())
        except OSError:
            return
        if parts is None or parts[0].get("key") != self._key:
            return  # rewritten by another runner sharing cache_dir, or damaged: leave it
        header, payload = parts
        header["choices"] = merged
        self._write(header, payload)
        self.choices_in_file = merged

    def _write(self, header: dict[str, Any], payload: bytes) -> None:
        """The file of ``header`` and ``payload``, atomically (a reader never sees half a file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".dgcache-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(_MAGIC + json.dumps(header, sort_keys=True, default=str).encode() + b"\n" + payload)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "status": self.status,
            "loaded": self.loaded,
            # "loaded": the forward came from the file whole (no trace); "saved": written for the next start.
            "precompiled": "loaded"
            if self.precompiled is not None
            else "saved"
            if self.saved_precompiled
            else None,
        }
