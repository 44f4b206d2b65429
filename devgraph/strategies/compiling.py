"""``torch.compile`` as the graph strategies use it: compile once for every size, count compiles, report a
recompile after capture, and leave nothing behind when a runner closes.

* **One compile for every size.** The forward is compiled with the leading dimension of its tensor
  arguments dynamic (and nothing else), with
  ``backed_size_oblivious`` on while dynamo traces (a size of 1 gets no specialised second compile) and
  duck shaping off (a size equal to a weight's width, 4096 tokens against a hidden size of 4096, gets no
  guard of its own); each inductor compile of a real model costs tens of seconds. Where dynamo cannot
  trace the forward that way (a data-dependent guard, a forward that specialises on the batch size), each
  size is compiled with static shapes instead, and the capture report says why and what it cost
  (:mod:`devgraph.strategies.adaptive`).
* **A code object per backend.** dynamo keeps its cache entries on the code object it compiled and stops
  at a recompile limit (8) per code object. Compiling a trampoline whose code object belongs to this
  backend alone (it inlines the user's forward) means a closed runner's entries die with it, and the ninth
  runner over one forward compiles like the first.
* **Model floats stay constants** (``specialize_float``): an engine's hyperparameters do not change
  between steps, and a float turned into a graph input would be read on the host by ops taking floats.
* **Recompiles after capture** are bugs (graphs are bypassed for those shapes): counted, logged, or
  raised as :class:`~devgraph.errors.RecompileError` with ``on_recompile="raise"``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import Compiler
from devgraph.contract.platform import Availability, GraphPlatform
from devgraph.errors import ConfigError, RecompileError
from devgraph.messages import shorten
from devgraph.strategies._base import GraphStrategy
from devgraph.strategies.adaptive import AdaptiveCompile
from devgraph.strategies.inplace import keep_writes_in_place
from devgraph.strategies.regions import RegionalForward, block_forward, repeated_block
from devgraph.strategies.regions import describe as regional_describe

__all__ = [
    "CompileSession",
    "CompilingStrategy",
    "CompileTracker",
    "compile_forward",
    "dynamo_availability",
    "check_compiler",
    "inductor_compile",
]

logger = logging.getLogger(__name__)


def check_compiler(compiler: str | None, strategy: str) -> str | None:
    """``compiler`` if it is a known compiler name (``None`` passes), else :class:`ConfigError`."""
    if compiler is None:
        return None
    try:
        return Compiler(compiler).value
    except ValueError:
        accepted = ", ".join(c.value for c in Compiler)
        raise ConfigError(
            f"{strategy} compiler {shorten(compiler)} is unknown; accepted: {accepted}"
        ) from None


def dynamo_availability(platform: GraphPlatform) -> Availability:
    """The platform's availability, and whether torch.compile can run here at all."""
    base = platform.availability()
    if not base:
        return base
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:  # e.g. a Python version this torch's dynamo does not support
        return Availability(False, f"torch.compile is unavailable here ({exc}); use 'full' or 'breakable'")
    return Availability(True)


class CompileTracker:
    """Counts compiles; after :meth:`seal` (capture finished) a compile is a recompile to report."""

    def __init__(self, strategy: str, on_recompile: str) -> None:
        if on_recompile not in ("warn", "raise"):
            raise ConfigError(f"on_recompile must be 'warn' or 'raise', got {shorten(on_recompile)}")
        self.strategy = strategy
        self.on_recompile = on_recompile
        self.compiles = 0
        self.recompiles = 0
        self.sealed = False

    def compiled(self) -> None:
        """Called by the dynamo backend at every compile."""
        self.compiles += 1
        if not self.sealed:
            return
        self.recompiles += 1
        message = (
            f"{self.strategy} recompiled after capture (recompile #{self.recompiles}): the captured graphs "
            "are bypassed for the shapes that triggered it. Usually an input changed dtype, device or "
            "rank, or a Python value the forward branches on changed; run with TORCH_LOGS=recompiles to "
            "see the failing guard, and keep inputs in the runner's static buffers"
        )
        if self.on_recompile == "raise":
            raise RecompileError(message)
        logger.warning(message)

    def seal(self) -> None:
        self.sealed = True

    def unseal(self) -> None:
        self.sealed = False


def compile_forward(
    forward: Callable[..., Any], dynamo_backend: Callable[..., Any], strategy: str
) -> AdaptiveCompile:
    """``forward`` compiled through ``dynamo_backend``: once with a dynamic leading dimension, or size by size
    with static shapes where dynamo cannot trace that (:class:`AdaptiveCompile`).

    A forward no compile can run raises :class:`CaptureError` naming both causes and the fix; a
    :class:`RecompileError` from the backend comes back as is.
    """
    return _Unwrapping(forward, dynamo_backend, f"{strategy}'s compiled forward", dynamic_args=None)


class _Unwrapping(AdaptiveCompile):
    """Hands devgraph's own :class:`RecompileError` back unwrapped (dynamo wraps what a backend raises)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, RecompileError):
                raise inner from None
            raise


def inductor_compile(
    module: torch.fx.GraphModule, example: list[Any], mode: str | None
) -> Callable[..., Any]:
    """Compile ``module`` with inductor in ``mode`` (its CUDA graphs off: devgraph captures its own)."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
    patches["triton.cudagraphs"] = False
    compiled: Callable[..., Any] = compile_fx(module, example, config_patches=patches)  # type: ignore[assignment]
    return compiled


class CompileSession:
    """The compile side of a compiling strategy: the compiled forward, its counters, its artifact cache."""

    def __init__(self, strategy: str, options: Any, platform: GraphPlatform) -> None:
        self.strategy = strategy
        self.options = options
        self.platform = platform
        self.tracker = CompileTracker(strategy, options.on_recompile)
        self.cache: Any = None
        self._forward: Callable[..., Any] | None = None
        self._compiled: AdaptiveCompile | None = None
        self._wrapped: Callable[..., Any] | None = None
        #: Where Triton keeps its compiled kernels (under ``cache_dir`` unless the user chose), once prepared.
        self.triton_cache: str | None = None
        #: The regional compile (:mod:`.regions`): which block, or why none (``None``: not asked for).
        self.regions: dict[str, Any] | None = None
        #: Writes into views of the forward's inputs kept in place for inductor (:mod:`.inplace`).
        self.writes_in_place = 0

    def wrap(
        self, forward: Callable[..., Any], dynamo_backend: Callable[..., Any], *, regions: bool = False
    ) -> Callable[..., Any]:
        """The compiled ``forward`` (compiling happens at its first call). A backend handed on to a runner
        with another forward compiles that one, with fresh counters and no cache of the old one's.

        ``regions``: compile the model's repeated block once instead of the whole forward
        (:mod:`.regions`), where the forward is a method of a model that has one."""
        if self._compiled is None or self._forward is not forward:
            self._forward = forward
            self.tracker = CompileTracker(self.strategy, self.options.on_recompile)
            self.cache = None
            self._wrapped = self._compiled = None
            self.regions = None
            block = repeated_block(getattr(forward, "__self__", None)) if regions else None
            if regions and block is None:
                self.regions = {
                    "block": None,
                    "why": "no nn.ModuleList of modules of one class: compiled whole",
                }
            if block is not None:
                name, layers = block
                self.regions = regional_describe(name, layers)
                what = f"{self.strategy}'s compiled {type(layers[0]).__name__} block"
                self._compiled = _Unwrapping(block_forward(layers), dynamo_backend, what, dynamic_args=None)
                self._wrapped = RegionalForward(forward, layers, self._compiled)
            else:
                self._compiled = compile_forward(forward, dynamo_backend, self.strategy)
                self._wrapped = self._compiled
        assert self._wrapped is not None
        return self._wrapped

    def prepare(self, inputs: Any, keys: Any, compiler: str | None) -> None:
        """Before the first compile: load the artifacts of an earlier process when ``cache_dir`` is set."""
        if not self.options.cache_dir or self._forward is None or self.cache is not None:
            return
        from devgraph.strategies.artifacts import ArtifactCache, fingerprint, keep_triton_kernels

        self.triton_cache = keep_triton_kernels(self.options.cache_dir)

        options = {
            "strategy": self.strategy,
            "compiler": compiler,
            "inductor_mode": self.options.inductor_mode,
        }
        specs = [
            f"{name}:{spec.dtype}:{spec.shape}:{spec.axis}:{spec.extra_rows}" for name, spec in inputs.items()
        ]
        print_ = fingerprint(self._forward, self.platform.device_type, options, specs, [str(k) for k in keys])
        self.cache = ArtifactCache(self.options.cache_dir, self._forward, print_)
        compiled = self._compiled
        unsupported = self._precompile_unsupported(compiler)
        self.cache.precompile = unsupported is None
        start = time.perf_counter()
        self.cache.load()
        if compiled is None:
            return
        compiled.startup.loaded(self.cache.loaded, time.perf_counter() - start)
        if self.cache.precompiled is not None:
            compiled.precompiled = self.cache.precompiled
        elif unsupported is None:
            compiled.want_precompile = True  # compile ahead of time, so that the next start loads it whole
        else:
            compiled.precompile_skipped = unsupported

    def _precompile_unsupported(self, compiler: str | None) -> str | None:
        """Why this session's compile cannot be saved as a dynamo-free function, or ``None``."""
        if self.strategy != "full" or compiler != Compiler.INDUCTOR.value:
            return "only full with the inductor compiler is precompiled"
        if self.regions is not None and self.regions.get("block"):
            return "a regional compile is kept through torch's cache artifacts only"
        from devgraph.strategies.precompile import precompile_support

        return precompile_support(self._forward) if self._forward is not None else "no forward"

    @property
    def earlier_choices(self) -> dict[str, dict[str, Any]]:
        """The compiled-or-plain choices the artifact file loaded holds (empty without a hit)."""
        if self.cache is None or self.cache.loaded != "hit":
            return {}
        return self.cache.choices  # type: ignore[no-any-return]

    def captured(self, choices: dict[str, dict[str, Any]] | None = None) -> None:
        """After a capture session: save new artifacts (with ``choices``, the strategy's compiled-or-plain
        choice per key), and treat any later compile as a recompile."""
        compiled = self._compiled
        fresh = compiled is not None and compiled.precompiled is not None
        fresh = fresh and self.cache is not None and self.cache.precompiled is None
        if self.cache is not None and (self.cache.status in ("miss", "stale", "corrupt") or fresh):
            self._save(compiled.precompiled if fresh and compiled is not None else None, choices)
        elif self.cache is not None and choices and self.cache.status in ("hit", "saved"):
            try:  # keys captured after the file was written (lazily): their choices join it
                self.cache.add_choices(choices)
            except OSError as exc:
                logger.warning("devgraph: could not update compile cache %s: %s", self.cache.path, exc)
        self.tracker.seal()

    def _save(self, precompiled: Any, choices: dict[str, dict[str, Any]] | None = None) -> None:
        from devgraph.strategies.precompile import serialize

        data = b""
        if precompiled is not None and self._forward is not None:
            try:
                data = serialize(precompiled, self._forward)
            except Exception as exc:  # noqa: BLE001 - experimental in torch: keep the traced path's file
                logger.warning(
                    "devgraph: the precompiled forward could not be saved (%s); a warm start "
                    "will trace again",
                    exc,
                )
        try:
            self.cache.save(data, choices)
        except OSError as exc:
            logger.warning("devgraph: could not write compile cache %s: %s", self.cache.path, exc)

    def reset(self) -> None:
        self.tracker.unseal()

    def notes(self) -> list[str]:
        """Lines for the capture report: a dynamic compile given up for per-size compiles, and why."""
        note = self._compiled.note() if self._compiled is not None else None
        return [note] if note else []

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "compiles": self.tracker.compiles,
            "recompiles": self.tracker.recompiles,
            "writes_kept_in_place": self.writes_in_place,
        }
        if self._compiled is not None:
            out.update(self._compiled.describe())
        if self.cache is not None:
            out["artifact_cache"] = self.cache.describe()
        if self.regions is not None:
            out["regions"] = self.regions
        if self.triton_cache is not None:
            out["triton_cache_dir"] = self.triton_cache
        return out


class CompilingStrategy(GraphStrategy):
    """A graph strategy that may run the forward through ``torch.compile``: the compile hooks every such
    strategy shares, in one place. A subclass says how dynamo's graph becomes code
    (:meth:`_compile_graph`) and wraps the forward (``self.compile.wrap``) in its ``wrap_forward``.

    ``compiler`` is the options' compiler, else :attr:`default_compiler` (``None``: nothing is compiled
    and every hook here does nothing); ``compile`` is the :class:`CompileSession` (the compiled forward,
    its counters, the artifact cache).
    """

    #: The compiler used when the options name none (``None``: the plain forward unless one is asked for).
    default_compiler: ClassVar[str | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiler = check_compiler(self.options.compiler, self.name) or self.default_compiler
        self.compile = CompileSession(self.name, self.options, self.platform)

    @property
    def compiles(self) -> int:
        return self.compile.tracker.compiles

    @property
    def recompiles(self) -> int:
        return self.compile.tracker.recompiles

    def prepare(self, inputs: Mapping[str, StaticInput], keys: Sequence[GraphKey] = ()) -> None:
        if self.compiler is not None:
            self.compile.prepare(inputs, keys, self.compiler)

    def _dynamo_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """What dynamo calls with each graph it traced: counted (a compile after capture is reported),
        inductor's in-place writes kept, then :meth:`_compile_graph`."""
        self.compile.tracker.compiled()
        if self.compiler == Compiler.INDUCTOR.value:
            self.compile.writes_in_place += keep_writes_in_place(gm)
        return self._compile_graph(gm, example_inputs)

    @abstractmethod
    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The code that runs dynamo's graph ``gm`` under this strategy's compiler."""

    @contextlib.contextmanager
    def capture_session(self, stream: Any, *, shared_pool: bool = True) -> Iterator[None]:
        with super().capture_session(stream, shared_pool=shared_pool):
            yield
        if self.compiler is not None:
            # Save new artifacts; from here on a compile means a guard failed at run time: a bug to report.
            self.compile.captured(self.choices_to_keep())

    def choices_to_keep(self) -> dict[str, dict[str, Any]]:
        """What the artifact file keeps of this strategy's per-key choices for a later process (none here;
        ``full`` keeps its compiled-or-plain choice)."""
        return {}

    def cleanup(self) -> None:
        super().cleanup()
        self.compile.reset()

    def capture_notes(self) -> list[str]:
        return self.compile.notes()

    def describe(self) -> dict[str, Any]:
        return {"compiler": self.compiler, **self.compile.describe()}
