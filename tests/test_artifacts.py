"""Warm restarts: the compile-artifact cache of compiling strategies (devgraph/strategies/artifacts.py).

A process that compiles with inductor saves its artifacts under ``cache_dir``; a later process loads them
(``inspect()["artifact_cache"]["status"] == "hit"``) and gets bit-identical outputs. A file made for
another model or other sizes is *stale*, a damaged one *corrupt*: neither is used, and both are rebuilt.

Each process gets an inductor cache directory of its own, so what a process finds compiled can only come
from devgraph's artifact file. The model is two matmuls: inductor turns it into calls of the extern GEMM
without C++ kernels of its own, which keeps each process at a few seconds (on the CPU the artifacts carry
inductor's graphs, not compiled C++, so a model with pointwise kernels recompiles those in every process).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from devgraph.strategies import artifacts
from devgraph.strategies.artifacts import ArtifactCache

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, logging, sys
    from pathlib import Path

    import torch
    from torch._dynamo.utils import counters

    from devgraph import BackendOptions, GraphRunner, StaticInput, resolve_platform
    from devgraph.strategies import FullGraphBackend


    class Mlp(torch.nn.Module):
        def __init__(self, width, seed=0):
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            self.w1 = torch.nn.Parameter(torch.randn(8, width, generator=generator), requires_grad=False)
            self.w2 = torch.nn.Parameter(torch.randn(width, 4, generator=generator), requires_grad=False)

        def forward(self, x):
            return (x @ self.w1) @ self.w2


    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())


    def damage(path, how):
        blob = path.read_bytes()
        if how == "flip":  # bytes of the payload flipped: its hash no longer matches
            blob = blob[:-64] + bytes(b ^ 0xFF for b in blob[-64:])
        elif how == "truncate":  # a write cut short
            blob = blob[: len(blob) // 2]
        elif how == "header":  # not a devgraph cache file at all
            blob = b"garbage" + blob[7:]
        elif how == "garble":  # the precompiled function's bytes garbled under a header that matches them
            magic_end = blob.index(b"\\n") + 1
            header_end = blob.index(b"\\n", magic_end)
            header, payload = json.loads(blob[magic_end:header_end]), bytearray(blob[header_end + 1 :])
            start = len(payload) - header["precompiled_bytes"]
            payload[start + 16 :] = bytes(b ^ 0x5A for b in payload[start + 16 :])
            header["sha256"] = hashlib.sha256(bytes(payload)).hexdigest()
            blob = blob[:magic_end] + json.dumps(header).encode() + b"\\n" + bytes(payload)
        path.write_bytes(blob)


    # Every dynamo trace, ahead of time or at a call, runs an instruction translator: count them.
    from torch._dynamo import symbolic_convert

    traced = [0]
    _run_translator = symbolic_convert.InstructionTranslatorBase.run

    def counting_run(self):
        traced[0] += 1
        return _run_translator(self)

    symbolic_convert.InstructionTranslatorBase.run = counting_run

    # dynamo patches torch.nn.Module.__init__ at the first compile of a process, and the fingerprint's code
    # digest reads it (test_the_fingerprint_does_not_depend_on_earlier_compiles): compile once first, so
    # every runner here fingerprints as the first runner of a process would once that is fixed.
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))
    cache_dir, steps = sys.argv[1], json.loads(sys.argv[2])
    keep = Keep()
    logging.getLogger("devgraph.strategies").addHandler(keep)
    results = []
    for step in steps:
        if step.get("damage"):  # the file written last (one per model: this step's model wrote it last)
            path = max(Path(cache_dir).glob("*.dgcache"), key=lambda p: p.stat().st_mtime_ns)
            damage(path, step["damage"])
        keep.messages.clear()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        traced[0] = 0
        model = Mlp(step["width"], step.get("seed", 0))
        inputs = {"x": StaticInput(torch.float32, (8,))}
        if step.get("options"):  # the cache configured through BackendOptions
            options = BackendOptions(compiler="inductor", cache_dir=cache_dir)
            backend = FullGraphBackend(resolve_platform("cpu"), phase="decode", options=options)
            runner = GraphRunner(model.forward, phase="decode", inputs=inputs, sizes=step["sizes"],
                                 backend=backend, progress=False)
        else:  # ... or through the flag's JSON
            flag = {"decode": {"backend": "full", "compiler": "inductor", "cache_dir": cache_dir,
                               "sizes": step["sizes"]}}
            runner = GraphRunner(model.forward, phase="decode", inputs=inputs, config=json.dumps(flag),
                                 device="cpu", progress=False)
        runner.capture()
        x = torch.linspace(-2, 2, 24).reshape(3, 8)
        out = runner.run(x=x, copy=True)
        info = runner.inspect()
        results.append({
            **info["artifact_cache"],
            "compiles": info["compiles"],
            "recompiles": info["recompiles"],
            "fx_hits": counters["inductor"]["fxgraph_cache_hit"] - hits,
            "traced": traced[0],
            "warnings": list(keep.messages),
            "output": [v.hex() for v in out.flatten().tolist()],
            "close_to_eager": torch.allclose(out, model(x), rtol=1e-5, atol=1e-5),
        })
        runner.close()
    print(json.dumps(results))
    """
)


def _run(tmp_path: Path, name: str, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``steps`` in a fresh process with an empty inductor cache of its own."""
    script = tmp_path / "warm_restart.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}
    env.pop("TORCHINDUCTOR_FX_GRAPH_CACHE", None)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), json.dumps(steps)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


BASE = {"width": 16, "sizes": [1, 2, 4]}


@pytest.mark.slow
def test_a_second_process_reuses_the_cache_and_rejects_a_stale_or_corrupt_one(tmp_path: Path) -> None:
    (cold,) = _run(tmp_path, "first", [{**BASE, "options": True}])
    assert cold["status"] == "saved" and cold["fx_hits"] == 0 and not cold["warnings"]  # a miss: compiled
    assert (cold["compiles"], cold["recompiles"]) == (1, 0) and cold["close_to_eager"]
    assert Path(cold["path"]).parent == tmp_path / "cache"

    assert cold["precompiled"] == "saved" and cold["traced"] >= 1  # compiled ahead of time, saved whole

    steps = [BASE, {**BASE, "seed": 1}, {**BASE, "sizes": [1, 2, 8]}, {**BASE, "width": 24}]
    warm, weights, sizes, model = _run(tmp_path, "second", steps)
    # The flag's cache_dir and BackendOptions.cache_dir name the same file; the compiled forward came from it
    # whole: dynamo traced nothing and inductor compiled nothing.
    assert warm["path"] == cold["path"]
    assert warm["status"] == "hit" and warm["precompiled"] == "loaded" and not warm["warnings"]
    assert warm["traced"] == 0 and (warm["compiles"], warm["recompiles"]) == (0, 0)
    assert warm["output"] == cold["output"]  # bit-identical to the first process
    # Other weights of the same shapes: the same file, run with this process's weights (none are saved in it).
    assert weights["status"] == "hit" and weights["precompiled"] == "loaded" and weights["traced"] == 0
    assert weights["close_to_eager"] and weights["output"] != warm["output"]
    # Other sizes: the same runner built otherwise, stale, not used, rebuilt in place.
    assert any("is stale" in w and "not used" in w for w in sizes["warnings"]), sizes["warnings"]
    assert sizes["status"] == "saved" and sizes["close_to_eager"] and sizes["path"] == cold["path"]
    # Other parameter shapes (another model of the same class: a draft beside its target): a file of its own.
    assert model["status"] == "saved" and model["loaded"] == "miss" and not model["warnings"]
    assert model["path"] != cold["path"] and model["close_to_eager"]

    damaged = _run(
        tmp_path,
        "third",
        [
            {**BASE, "width": 24, "damage": "flip"},
            {**BASE, "width": 24, "damage": "truncate"},
            {**BASE, "width": 24, "damage": "header"},
            {**BASE, "width": 24, "damage": "garble"},
            {**BASE, "width": 24},
        ],
    )
    flipped = damaged[0]
    # Not used: nothing of it reached inductor (this process's own inductor cache started empty).
    assert flipped["fx_hits"] == 0 and flipped["close_to_eager"]
    for result in damaged[:4]:
        assert any("is corrupt" in w and "rebuilt" in w for w in result["warnings"]), result["warnings"]
        assert result["status"] == "saved"  # rebuilt by the process that found it damaged
    garbled = damaged[3]  # torch could not rebuild the function: compiled cold, same outputs, no crash
    assert garbled["traced"] >= 1 and garbled["close_to_eager"] and garbled["output"] == flipped["output"]
    rebuilt = damaged[4]
    assert rebuilt["status"] == "hit" and rebuilt["precompiled"] == "loaded" and not rebuilt["warnings"]
    assert rebuilt["traced"] == 0 and rebuilt["output"] == flipped["output"]


# -- the file format, without compiling -----------------------------------------------------------------
def _fingerprint(keys: list[str]) -> dict[str, Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    options = {"strategy": "full", "compiler": "inductor", "inductor_mode": None}
    return artifacts.fingerprint(forward, "cpu", options, ["x:float32"], keys)


def _write(path: Path, key_of: dict[str, Any], payload: bytes, **header: Any) -> None:
    cache = ArtifactCache(str(path.parent), lambda: None, key_of)
    fields = {
        "format": 1,
        "key": cache._key,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "bytes": len(payload),
        **header,
    }
    path.write_bytes(artifacts._MAGIC + json.dumps(fields).encode() + b"\n" + payload)


@pytest.mark.parametrize(
    ("make", "status"),
    [
        (lambda p, fp: None, "miss"),
        (lambda p, fp: _write(p, _fingerprint(["tokens=8"]), b"payload"), "stale"),
        (lambda p, fp: _write(p, fp, b"payload", sha256="0" * 64), "corrupt"),
        (lambda p, fp: _write(p, fp, b"payload", bytes=3), "corrupt"),
        (lambda p, fp: _write(p, fp, b"payload", format=99), "corrupt"),
        (lambda p, fp: p.write_bytes(artifacts._MAGIC + b"{not json\npayload"), "corrupt"),
        (lambda p, fp: p.write_bytes(artifacts._MAGIC + b"no header end"), "corrupt"),
        (lambda p, fp: p.write_bytes(b"PK\x03\x04 another format"), "corrupt"),
        # torch logs and returns None, without raising, when it cannot read a payload.
        (lambda p, fp: _write(p, fp, b"not torch's artifact bytes"), "corrupt"),
    ],
    ids=["missing", "other-keys", "hash", "length", "format", "json", "no-header", "magic", "payload"],
)
def test_a_cache_file_is_checked_before_it_is_used(tmp_path: Path, make, status: str) -> None:  # type: ignore[no-untyped-def]
    fingerprint = _fingerprint(["tokens=4", "tokens=2"])
    cache = ArtifactCache(str(tmp_path), lambda: None, fingerprint)
    cache.path = tmp_path / "forward.dgcache"
    make(cache.path, fingerprint)
    assert cache.load() == status and cache.describe()["status"] == status


def test_the_fingerprint_follows_what_invalidates_compiled_code() -> None:
    base = _fingerprint(["tokens=2"])
    assert base["torch"] == torch.__version__ and base["device"] == "cpu"
    assert _fingerprint(["tokens=2"]) == base  # stable for the same runner
    assert _fingerprint(["tokens=4"])["keys"] != base["keys"]

    class Net(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    options = {"strategy": "full", "compiler": "inductor", "inductor_mode": None}
    small, wide = (artifacts.fingerprint(Net(w).forward, "cpu", options, [], []) for w in (4, 8))
    assert small["model"] != wide["model"] and small["code"] == wide["code"]
    assert artifacts.fingerprint(Net(4).forward, "cpu", options, [], [])["model"] == small["model"]


FINGERPRINT_TWICE = textwrap.dedent(
    """
    import torch
    from devgraph.strategies.artifacts import fingerprint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return x * self.w

    options = {"strategy": "full", "compiler": "inductor", "inductor_mode": None}
    before = fingerprint(Net().forward, "cpu", options, [], [])
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))  # any compile, e.g. another runner's
    after = fingerprint(Net().forward, "cpu", options, [], [])
    print(before == after)
    """
)


def test_the_fingerprint_does_not_depend_on_earlier_compiles() -> None:
    run = subprocess.run(
        [sys.executable, "-c", FINGERPRINT_TWICE], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.strip() == "True"


def test_the_load_outcome_is_kept_after_a_save(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fingerprint = _fingerprint(["tokens=4"])
    cache = ArtifactCache(str(tmp_path), lambda: None, fingerprint)
    cache.path = tmp_path / "forward.dgcache"
    _write(cache.path, _fingerprint(["tokens=8"]), b"payload")
    assert cache.load() == "stale"
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"new payload", None))
    cache.save()
    assert cache.describe() == {
        "path": str(cache.path),
        "status": "saved",
        "loaded": "stale",
        "precompiled": None,
    }


# -- the code fingerprint follows what the forward calls (issue 27) ----------------------------------------
HELPER_MODULE = """
import functools
import torch

SCALE = {scale}


def helper(x):
    return x * {factor}


def _deep(x):
    return x + {deep}


def middle(x):
    return _deep(x) * SCALE


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.post = functools.partial(middle)

    def forward(self, x):
        return helper(x * self.w) + self.post(x)
"""


def _helper_model(tmp_path: Path, name: str, **values: Any) -> Any:
    import importlib.util

    source = HELPER_MODULE.format(**{"scale": 1.0, "factor": 2, "deep": 3, **values})
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


def test_the_fingerprint_follows_the_helpers_the_forward_calls(tmp_path: Path) -> None:
    options = {"strategy": "full", "compiler": "inductor", "inductor_mode": None}

    def code_of(**values: Any) -> str:
        model = _helper_model(tmp_path, f"m{len(list(tmp_path.iterdir()))}", **values)
        return str(artifacts.fingerprint(model.forward, "cpu", options, [], [])["code"])

    base = code_of()
    assert code_of() == base  # the same source: the same digest
    assert code_of(factor=3) != base  # a module-level helper the forward calls changed
    assert code_of(deep=4) != base  # a helper two calls away, reached through functools.partial
    assert code_of(scale=0.5) != base  # a global constant a helper reads


def test_a_changed_helper_misses_the_cache_instead_of_running_old_code(tmp_path: Path) -> None:
    options = {"strategy": "full", "compiler": "inductor", "inductor_mode": None}
    before = _helper_model(tmp_path, "before")
    after = _helper_model(tmp_path, "after", factor=3)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    saved = ArtifactCache(
        str(cache_dir), before.forward, artifacts.fingerprint(before.forward, "cpu", options, [], [])
    )
    _write(saved.path, saved.fingerprint, b"payload")
    again = ArtifactCache(
        str(cache_dir), after.forward, artifacts.fingerprint(after.forward, "cpu", options, [], [])
    )
    assert again.path == saved.path  # the same model and inputs name the same file...
    assert again.load() == "stale"  # ... whose code no longer matches: rebuilt, never run


def test_triton_kernels_are_kept_under_cache_dir_unless_the_user_chose(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert artifacts.keep_triton_kernels(str(tmp_path)) == str(tmp_path.resolve() / "triton")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path.resolve() / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert artifacts.keep_triton_kernels(str(tmp_path)) == "/elsewhere"


def _entry(root: Path, name: str, mtime: float) -> Path:
    entry = root / name
    entry.mkdir(parents=True)
    (entry / "__triton_launcher.so").write_bytes(name.encode())
    os.utime(entry, (mtime, mtime))
    return entry


def test_this_process_s_triton_entries_move_with_the_cache(tmp_path: Path) -> None:
    old, new = tmp_path / "home-cache", tmp_path / "kept"
    _entry(old, "a" * 8, 1000.0)  # another process's, long ago
    _entry(old, "b" * 8, 5000.0)
    _entry(old, "c" * 8, 6000.0)
    (new / ("c" * 8)).mkdir(parents=True)  # already there: kept as it is
    (old / "stray-file").write_text("not an entry")
    assert artifacts.carry_triton_entries(old, new, since=4000.0) == 1
    assert sorted(p.name for p in new.iterdir()) == ["b" * 8, "c" * 8]
    assert (new / ("b" * 8) / "__triton_launcher.so").read_bytes() == b"b" * 8
    assert not any((new / ("c" * 8)).iterdir())
    assert artifacts.carry_triton_entries(old, tmp_path / "more", since=0.0, most=1) == 1


def test_a_carried_kernel_is_found_in_its_new_cache_once_the_old_one_is_gone(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # A real Triton compile (for an H100's architecture: no GPU needed) into one cache, carried into
    # another, the first deleted: every file the kernel's group file names is in the new cache, and
    # Triton's own lookup finds the group there.
    import shutil
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("triton")
    old, new = tmp_path / "old", tmp_path / "new"
    script = textwrap.dedent(
        """
        import sys
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget

        @triton.jit
        def copy(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

        source = triton.compiler.ASTSource(
            fn=copy, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 16}
        )
        try:
            triton.compile(source, target=GPUTarget("cuda", 90, 32))
        except Exception as exc:
            print("no compile:", repr(exc)[:200])
            sys.exit(3)
        """
    )
    env = {**os.environ, "TRITON_CACHE_DIR": str(old)}
    compile_script = tmp_path / "compile_one.py"  # a file: Triton reads a kernel's source
    compile_script.write_text(script)
    done = subprocess.run(
        [sys.executable, str(compile_script)], env=env, capture_output=True, text=True, timeout=240
    )
    if done.returncode == 3:
        pytest.skip(f"Triton cannot compile for sm_90 here: {done.stdout.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert artifacts.carry_triton_entries(old, new, since=0.0) >= 1
    shutil.rmtree(old)
    groups = list(new.glob("*/__grp__*.json"))
    assert groups
    for group in groups:
        children = json.loads(group.read_text())["child_paths"]
        assert children and all(
            Path(p).exists() and Path(p).parent == group.parent for p in children.values()
        )
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(new))
    for group in groups:
        manager = FileCacheManager(group.parent.name)
        assert manager.get_group(group.name.removeprefix("__grp__")) is not None


def test_an_entry_that_cannot_be_copied_is_skipped_and_leaves_nothing_behind(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _entry(old, "f" * 8, 5000.0)
    bad = _entry(old, "g" * 8, 5000.0)
    (bad / "__grp__k.json").write_text("[1, 2]")  # a group file that is not an object
    (bad / "unreadable").mkdir()
    (bad / "unreadable" / "x").write_text("x")
    (bad / "unreadable").chmod(0)
    outside = tmp_path / "secret"
    outside.write_text("not Triton's")
    (_entry(old, "h" * 8, 5000.0) / "link").symlink_to(outside)
    try:
        carried = artifacts.carry_triton_entries(old, new, since=0.0)
    finally:
        (bad / "unreadable").chmod(0o755)
    names = sorted(p.name for p in new.iterdir())
    assert not [n for n in names if n.startswith(".")]  # no staging folder left behind
    assert "f" * 8 in names and "h" * 8 in names and carried == len(names)
    assert (new / ("h" * 8) / "link").is_symlink()  # copied as a link, its target not read in


def test_a_missing_source_carries_nothing_and_raises_nothing(tmp_path: Path) -> None:
    assert artifacts.carry_triton_entries(tmp_path / "absent", tmp_path / "kept", since=0.0) == 0


def test_the_move_to_cache_dir_carries_what_this_process_built(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    old = tmp_path / "home-cache"
    _entry(old, "d" * 8, 9000.0)
    _entry(old, "e" * 8, 10.0)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(artifacts, "_triton_cache_in_use", lambda: str(old))
    monkeypatch.setattr(artifacts, "_process_started", lambda: 100.0)
    kept = Path(artifacts.keep_triton_kernels(str(tmp_path / "cache")))
    assert sorted(p.name for p in kept.iterdir()) == ["d" * 8]


def test_a_fresh_process_knows_it_started_a_moment_ago() -> None:
    import subprocess
    import sys
    import time

    before = time.time()
    code = "from devgraph.strategies import artifacts; print(artifacts._process_started())"
    started = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    if started == float("inf"):
        pytest.skip("no /proc here: nothing is taken for this process's own")
    assert before - 30.0 <= started <= time.time()  # /proc's boot time is whole seconds, and VMs drift


@pytest.mark.parametrize(("compiler", "status"), [("eager", "hit"), ("inductor", "stale")])
def test_a_file_of_choices_only_is_a_hit_only_for_a_compiler_that_leaves_no_artifacts(
    tmp_path: Path, monkeypatch, compiler: str, status: str
) -> None:  # type: ignore[no-untyped-def]
    """``eager`` saves no artifacts: a file of the compiled-or-plain choices is all a warm start can load.
    For inductor the same file (written where torch had no artifacts to save) holds none of the compiled
    code: counted a hit, it said "loaded" while every start compiled from scratch, and, being a hit, was
    never written again once artifacts could be saved."""
    fingerprint = _fingerprint(["tokens=4"])
    fingerprint["options"] = {**fingerprint["options"], "compiler": compiler}
    writer = ArtifactCache(str(tmp_path), lambda: None, fingerprint)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    writer.save(choices={"tokens=4": {"kept": "plain", "compiled_s": 2e-3, "plain_s": 1e-3}})
    reader = ArtifactCache(str(tmp_path), lambda: None, fingerprint)
    assert reader.path == writer.path and reader.load() == status
    assert bool(reader.choices) is (status == "hit")
