"""Start-up of compiled ``full``: cold, warm without re-tracing, and reduce-overhead's warm-up, with where the
seconds go.

    python benchmarks/bench_startup_compile.py --out $OUT/startup.json --time-budget 480
    python benchmarks/bench_startup_compile.py --smoke   # the script on the CPU (tiny preset, CPU inductor)

Fresh processes, one after the other, each with its own empty ``TORCHINDUCTOR_CACHE_DIR`` (reduce-overhead's
with an empty ``TRITON_CACHE_DIR`` too; see below for devgraph's). Each builds the
reference model (``qwen3-0.6b``, bf16, paged attention, seeded) and times ``capture()`` of a decode runner
``{"decode": {"backend": "full", "compiler": "inductor", "cache_dir": X}}`` over the decode sizes
(compile + warm-ups + capture): ``cold`` finds ``X`` empty (compiles ahead of time, saves the function),
``warm`` loads it (no dynamo trace, no inductor). ``reduce_overhead`` is ``torch.compile(model.decode_step,
mode="reduce-overhead")`` warmed up on the same sizes (3 calls each: warm-up, recording, first replay).
``cold_regions`` / ``warm_regions`` do the same with the repeated decoder layer compiled once instead of the
whole forward (``regions=True``). ``cold_traced`` / ``warm_traced`` repeat cold and warm with the
ahead-of-time path switched off (the traced path with torch's cache artifacts, devgraph's warm start before
it), when the budget allows. The devgraph processes keep Triton's kernels under ``cache_dir`` (devgraph's
default when ``TRITON_CACHE_DIR`` is unset; each runs with a fresh ``TRITON_HOME``), so only ``cache_dir``
carries anything between them. Each devgraph process saves the logits of fixed batches (512-token
contexts); the parent compares them bit for bit.
Targets (issue 31): cold warm-up <= 0.3x reduce-overhead's, warm start <= 3 s to the first graph replay, warm
bit-identical to cold.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from harness.cases import KVPlan
from harness.children import child_env, run_child, script_command
from harness.device import Budget, Device, start
from harness.report import Report, diff, environment, output_path
from harness.targets import Target, targets_table

from devgraph import create_backend
from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner
from devgraph.reference.fused import TRITON_SET_UP

log = logging.getLogger("bench_startup_compile")

CONTEXT = 512
#: Each child process, in order, and the seconds it may take at most.
CHILDREN = {
    "cold": 240.0,
    "warm": 120.0,
    "reduce_overhead": 240.0,
    "cold_regions": 180.0,
    "warm_regions": 90.0,
    "cold_traced": 240.0,
    "warm_traced": 120.0,
}


def _build(args: argparse.Namespace) -> tuple[Device, ReferenceModel, dict[str, dict[str, Any]], list[int]]:
    device = torch.device("cpu" if args.smoke else "cuda")
    overrides: dict[str, Any] = {"num_layers": 1, "max_requests": 8} if args.smoke else {}
    base = ReferenceConfig.preset("tiny" if args.smoke else "qwen3-0.6b", **overrides)
    kv = KVPlan(base, private_blocks=256)
    model = ReferenceModel(kv.config(base), device=device, seed=0)
    model.randomize_cache(seed=1)
    sizes = [b for b in args.sizes if b <= model.config.max_requests]
    context = min(CONTEXT, model.config.max_seq_len)
    inputs = {f"b{b}@{context}": kv.decode(model, b, context, seed=i) for i, b in enumerate(sizes)}
    return Device(device), model, inputs, sizes


def _count_traces() -> list[int]:
    """Count dynamo's traces in this process (every trace, ahead of time or at a call, runs one)."""
    from torch._dynamo import symbolic_convert

    traced = [0]
    original = symbolic_convert.InstructionTranslatorBase.run

    def counting(self: Any) -> Any:
        traced[0] += 1
        return original(self)

    symbolic_convert.InstructionTranslatorBase.run = counting  # type: ignore[method-assign]
    return traced


def _time_triton_compiles() -> list[tuple[str, float, float]]:
    """Time every Triton JIT compile in this process (a kernel built, or loaded from Triton's cache, on
    its first launch with a new specialisation): (kernel, start, seconds), start on the perf counter.
    Inductor's own kernels are built by its compile workers and show as compile time instead."""
    compiles: list[tuple[str, float, float]] = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return compiles
    original = getattr(JITFunction, "_do_compile", None)
    if original is None:  # an older Triton: not timed
        return compiles

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            name = getattr(getattr(self, "fn", None), "__name__", "?")
            compiles.append((name, start, time.perf_counter() - start))

    JITFunction._do_compile = timed
    return compiles


def _summarise_compiles(compiles: list[tuple[str, float, float]], start: float, end: float) -> dict[str, Any]:
    """Triton JIT compiles during capture: how many, their seconds, per kernel."""
    during = [(name, seconds) for name, at, seconds in compiles if start <= at <= end]
    kernels: dict[str, list[float]] = {}
    for name, seconds in during:
        entry = kernels.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + seconds, 3)
    return {
        "during_capture": len(during),
        "seconds_during_capture": round(sum(s for _, s in during), 3),
        "before_capture": sum(1 for _, at, _ in compiles if at < start),
        "by_kernel": kernels,
    }


def _profile_lines(profile: Any, top: int = 40) -> list[str]:
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    return [line.rstrip() for line in text.getvalue().splitlines() if line.strip()][-top - 2 :]


def devgraph_child(args: argparse.Namespace) -> dict[str, Any]:
    """One devgraph process: build, capture (timed, with the breakdown), run the fixed batches."""
    if args.traced:  # devgraph's earlier warm start: the traced path with torch's cache artifacts only
        from devgraph.strategies import precompile

        precompile.precompile_support = lambda forward: "switched off by the benchmark (--traced)"
    traced = _count_traces()
    triton_compiles = _time_triton_compiles()
    t0 = time.perf_counter()
    dev, model, inputs, sizes = _build(args)
    dev.sync()
    build_s = time.perf_counter() - t0
    options = {"compiler": "inductor", "cache_dir": args.cache_dir, "regions": args.regions}
    backend = create_backend(model.device, "decode", "full", options=options)
    runner = decode_runner(model, backend=backend, sizes=sizes, progress=False)
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    t1 = time.perf_counter()
    if profile is not None:
        profile.enable()
    runner.capture()
    dev.sync()
    warmup_s = time.perf_counter() - t1
    if profile is not None:
        profile.disable()
    first_case = next(iter(inputs))
    runner.run(**inputs[first_case])
    dev.sync()
    to_first_replay_s = time.perf_counter() - t1
    logits = {case: runner.run(copy=True, **batch).cpu() for case, batch in inputs.items()}
    vs_eager = {case: diff(logits[case], model.decode_step(**batch).cpu()) for case, batch in inputs.items()}
    torch.save(logits, args.logits)
    info = runner.inspect()
    startup = dict(info.get("startup") or {})
    # What is neither compiling nor loading: the warm-up runs and the captures of the sizes.
    startup["capture_and_warmups_s"] = round(
        warmup_s - startup.get("compile_wall_s", 0) - startup.get("load_s", 0), 3
    )
    result = {
        "meta": environment(dev),
        "sizes": sizes,
        "model_build_s": round(build_s, 2),
        "warmup_s": round(warmup_s, 3),
        "to_first_replay_s": round(to_first_replay_s, 3),
        "startup": startup,
        "regions": info.get("regions"),
        "compiled_or_plain": info.get("compiled_or_plain"),
        "triton_cache_dir": info.get("triton_cache_dir"),
        "dynamo_traces": traced[0],
        "compiles": info.get("compiles"),
        "recompiles": info.get("recompiles"),
        "artifact_cache": info.get("artifact_cache"),
        "precompiled": info.get("precompiled"),
        "precompile_skipped": info.get("precompile_skipped"),
        "compile": info.get("compile"),
        "vs_eager": vs_eager,
        "triton_jit_compiles": _summarise_compiles(triton_compiles, t1, t1 + warmup_s),
        "triton_set_up_in_background": dict(TRITON_SET_UP),
    }
    if profile is not None:
        result["profile_of_capture"] = _profile_lines(profile)
    runner.close()
    return result


def ro_child(args: argparse.Namespace) -> dict[str, Any]:
    """``torch.compile(model.decode_step, mode="reduce-overhead")`` warmed up on the same sizes."""
    from devgraph.strategies.compile_time import StartupClock

    dev, model, inputs, sizes = _build(args)
    compiled = torch.compile(model.decode_step, mode="reduce-overhead" if not args.smoke else None)
    clock = StartupClock()
    per_size: dict[str, float] = {}
    t0 = time.perf_counter()
    for case, batch in inputs.items():
        t1 = time.perf_counter()
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            with clock.timing():
                compiled(**batch)
        dev.sync()
        per_size[case] = round(time.perf_counter() - t1, 3)
    warmup_s = time.perf_counter() - t0
    return {
        "meta": environment(dev),
        "how": 'torch.compile(model.decode_step, mode="reduce-overhead"), 3 calls per size',
        "sizes": sizes,
        "warmup_s": round(warmup_s, 3),
        "warmup_s_per_size": per_size,
        "startup": clock.describe(),
    }


def _plot(path: Path, data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [k for k in CHILDREN if data.get(k)]
    parts = ("load_s", "dynamo_trace_s", "backend_s", "capture_and_warmups_s")
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, label in enumerate(labels):
        run = data[label]
        startup = run.get("startup") or {}
        bottom = 0.0
        other = run["warmup_s"]
        for j, part in enumerate(parts):
            seconds = float(startup.get(part) or 0.0)
            ax.bar(i, seconds, bottom=bottom, color=f"C{j}", label=part if i == 0 else None)
            bottom += seconds
            other -= seconds
        ax.bar(
            i, max(other, 0.0), bottom=bottom, color="C7", label="rest (guards, dispatch)" if i == 0 else None
        )
        ax.text(i, run["warmup_s"], f"{run['warmup_s']:.1f} s", ha="center", va="bottom")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("warm-up seconds (compile + warm-ups + capture)")
    ax.set_title(
        f"compiled full start-up, decode sizes {data['meta'].get('sizes')} ({data['meta'].get('device')})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parent(args: argparse.Namespace) -> int:
    budget = Budget(args.time_budget)
    path = output_path("startup.json", "benchmarks/results/h100-startup.json", args.out, args.smoke)
    report = Report(path, environment(Device("cpu")))
    data = report.data
    data["meta"]["how"] = __doc__.split("\n\n", 2)[2].strip()
    data["meta"]["sizes"] = args.sizes
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        root = Path(tmp)
        chosen = args.children.split(",") if args.children else list(CHILDREN)
        unknown = sorted(set(chosen) - set(CHILDREN))
        if unknown:
            data["errors"].append(f"unknown processes {unknown} (known: {', '.join(CHILDREN)})")
        for label, cap in ((label, CHILDREN[label]) for label in chosen if label in CHILDREN):
            traced = label.endswith("_traced")
            out, logits = root / f"{label}.json", root / f"{label}.pt"
            command = script_command(__file__, "--child", label, "--out", str(out), "--logits", str(logits))
            family = (
                "artifacts-traced" if traced else "artifacts-regions" if "regions" in label else "artifacts"
            )
            command += ["--cache-dir", str(root / family)]
            command += ["--sizes", ",".join(map(str, args.sizes))] + (["--smoke"] if args.smoke else [])
            command += ["--profile"] if args.profile else []
            if label == "cold_traced" and budget.left() < 2 * 60:
                data["errors"].append("time budget: the traced path's cold and warm processes were not run")
                break
            log.info("%s process (%.0f s of budget left)", label, budget.left())
            t0 = time.perf_counter()
            env = child_env(root, label)
            if label != "reduce_overhead":
                # devgraph keeps Triton's kernels under cache_dir (inductor's own cache stays empty per
                # process: only devgraph's cache_dir carries anything from one process to the next), as
                # for a user who gives cache_dir only. The model's set-up thread builds before the runner
                # points Triton there, into Triton's default cache: a fresh home per process keeps that
                # empty, so no process (nor a later run on the machine) finds another's kernels in it.
                env.pop("TRITON_CACHE_DIR", None)
                env["TRITON_HOME"] = str(root / f"{label}-triton-home")
            try:
                # The CPU smoke run compiles C++ kernels again at load: its caps are wider.
                data[label] = run_child(command, out, env, budget, cap=cap * (3 if args.smoke else 1))
                data[label]["process_wall_s"] = round(time.perf_counter() - t0, 1)
            except Exception as exc:
                report.error(f"{label} process", exc)
            report.save()
        for cold, warm in (
            ("cold", "warm"),
            ("cold_regions", "warm_regions"),
            ("cold_traced", "warm_traced"),
        ):
            if data.get(cold) and data.get(warm):
                first, second = torch.load(root / f"{cold}.pt"), torch.load(root / f"{warm}.pt")
                data[f"{warm}_bit_identical"] = {c: bool(torch.equal(first[c], second[c])) for c in first}
        if data.get("cold"):
            data["meta"]["device"] = data["cold"]["meta"].get("device")
            data["artifact_file_bytes"] = sum(
                f.stat().st_size for f in (root / "artifacts").glob("*.dgcache")
            )
    ro = data.get("reduce_overhead") or {}
    targets = []
    for suffix in ("", "_regions"):
        cold, warm = data.get(f"cold{suffix}") or {}, data.get(f"warm{suffix}") or {}
        same = data.get(f"warm{suffix}_bit_identical")
        ratio = cold["warmup_s"] / ro["warmup_s"] if cold.get("warmup_s") and ro.get("warmup_s") else None
        what = "regional compile" if suffix else "whole forward"
        targets += [
            Target(
                f"{what}: cold warm-up / reduce-overhead's",
                ratio,
                0.3,
                "x",
                detail=f"{cold.get('warmup_s')} s vs {ro.get('warmup_s')} s",
            ),
            Target(f"{what}: warm start to the first graph replay", warm.get("to_first_replay_s"), 3.0, "s"),
            Target(
                f"{what}: warm outputs bit-identical to cold (1 = yes)",
                None if same is None else float(all(same.values())),
                1.0,
                higher=True,
            ),
        ]
    data["targets"] = [t.as_dict() for t in targets]
    report.save()
    try:
        _plot(path.with_suffix(".png"), data)
    except Exception as exc:
        report.error("plot", exc)
        report.save()
    for label in CHILDREN:
        run = data.get(label) or {}
        print(
            f"{label}: warm-up {run.get('warmup_s')} s, traces {run.get('dynamo_traces')}, "
            f"startup {run.get('startup')}"
        )
    print(f"\nwrote {path}\n")
    print(targets_table(targets))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", help="JSON path (default $OUT/startup.json); the PNG goes beside it")
    parser.add_argument("--sizes", default="1,8,32,64", help="decode sizes, comma-separated")
    parser.add_argument("--time-budget", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument(
        "--children",
        help=f"comma-separated processes, in the order given (default: {','.join(CHILDREN)})",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="children profile their capture() (cProfile, top 40 in the JSON)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--logits", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    if not start(args.smoke):
        return 2
    if args.child:
        args.traced = args.child.endswith("_traced")
        args.regions = args.child.endswith("_regions")
        with torch.no_grad():
            result = ro_child(args) if args.child == "reduce_overhead" else devgraph_child(args)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
