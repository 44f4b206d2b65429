"""Warm restart: a second process's warm-up from devgraph's compile-artifact cache, against a cold first one.

    python benchmarks/bench_restart.py          # GPU: $OUT/restart.json (else benchmarks/results/)
    python benchmarks/bench_restart.py --smoke  # the script on the CPU (tiny preset, eager compiler)

Two fresh processes, one after the other, each with its own empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` (so inductor's and Triton's own disk caches cannot help the second). Each builds the
reference model (``qwen3-0.6b``, bf16, paged attention, seeded) and a decode runner
``{"decode": {"backend": "full", "compiler": "inductor", "cache_dir": X}}`` over batch sizes 1, 8, 32, 64; the
first finds ``X`` empty (cold: compiles, then saves its artifacts), the second loads them (warm). Warm-up =
``capture()`` wall time: compiling + warm-ups + capturing the four sizes. Each process saves the logits of
the same fixed batches (512-token contexts); the parent compares them bit for bit. Target: the second
warm-up <= 25 % of the first, outputs bit-identical.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from harness.cases import KVPlan
from harness.children import child_env
from harness.device import Device, start
from harness.report import Report, diff, environment, output_path
from harness.targets import Target, targets_table

from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner

log = logging.getLogger("bench_restart")

BATCHES = (1, 8, 32, 64)
CONTEXT = 512


def _count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root)) if root.exists() else 0


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process: build, capture (timed), run the fixed batches, save their logits."""
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    dev = Device(device)
    t0 = time.perf_counter()
    overrides: dict[str, Any] = {"num_layers": 1, "max_requests": 8} if smoke else {}
    base = ReferenceConfig.preset("tiny" if smoke else "qwen3-0.6b", **overrides)
    kv = KVPlan(base, private_blocks=256)
    model = ReferenceModel(kv.config(base), device=device, seed=0)
    model.randomize_cache(seed=1)
    batches = [b for b in BATCHES if b <= model.config.max_requests]
    context = min(CONTEXT, model.config.max_seq_len)
    inputs = {f"b{b}@{context}": kv.decode(model, b, context, seed=i) for i, b in enumerate(batches)}
    dev.sync()
    build_s = time.perf_counter() - t0
    mode = {"backend": "full", "compiler": args.compiler, "cache_dir": args.cache_dir}
    runner = decode_runner(model, config=json.dumps({"decode": mode}), sizes=list(batches), progress=False)
    t1 = time.perf_counter()
    runner.capture()
    dev.sync()
    warmup_s = time.perf_counter() - t1
    logits = {case: runner.run(copy=True, **batch).cpu() for case, batch in inputs.items()}
    eager = {case: diff(logits[case], model.decode_step(**batch).cpu()) for case, batch in inputs.items()}
    torch.save(logits, args.logits)
    inspect = runner.inspect()
    import torch._dynamo.utils as dynamo_utils

    result = {
        "meta": environment(dev),
        "model_build_s": round(build_s, 2),
        "warmup_s": round(warmup_s, 3),
        "capture_report_s": round(runner.report.seconds, 3) if runner.report else None,
        "compiles": inspect.get("compiles"),
        "recompiles": inspect.get("recompiles"),
        "artifact_cache": inspect.get("artifact_cache"),
        "inductor_counters": dict(dynamo_utils.counters.get("inductor", {})),
        "vs_eager": eager,
        "inductor_cache_files": _count_files(Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/nonexistent"))),
    }
    try:  # where the warm-up went: dynamo, AOT, inductor (cumulative seconds per phase)
        result["compile_times"] = dynamo_utils.compile_times(repr="str", aggregate=True)
    except Exception as exc:
        result["compile_times"] = f"unavailable: {exc}"
    runner.close()
    return result


def parent(args: argparse.Namespace) -> int:
    path = output_path("restart.json", "benchmarks/results/h100-restart.json", args.out, args.smoke)
    report = Report(path, environment(Device("cpu")))  # the children report their device
    data = report.data
    data["meta"]["how"] = __doc__.split("\n\n", 2)[2].strip()
    data["meta"]["compiler"] = args.compiler
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        root = Path(tmp)
        cache_dir = root / "artifacts"
        runs: dict[str, dict[str, Any]] = {}
        for label in ("cold", "warm"):
            env = child_env(root, label)
            out, logits = root / f"{label}.json", root / f"{label}.pt"
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                "--cache-dir",
                str(cache_dir),
            ]
            command += ["--compiler", args.compiler, "--out", str(out), "--logits", str(logits)]
            command += ["--smoke"] if args.smoke else []
            log.info("%s process: %s", label, " ".join(command))
            t0 = time.perf_counter()
            try:
                subprocess.run(command, env=env, check=True, timeout=args.timeout)
                runs[label] = json.loads(out.read_text())
                runs[label]["process_wall_s"] = round(time.perf_counter() - t0, 1)
            except Exception as exc:
                report.error(f"{label} process", exc)
            data[label] = runs.get(label)
            report.save()
        if "cold" in runs and "warm" in runs:
            data["meta"]["device"] = runs["cold"]["meta"]["device"]
            first = torch.load(root / "cold.pt")
            second = torch.load(root / "warm.pt")
            data["bit_identical"] = {case: bool(torch.equal(first[case], second[case])) for case in first}
            data["max_abs_diff"] = {case: diff(second[case], first[case])["max_abs"] for case in first}
            data["artifact_file_bytes"] = sum(f.stat().st_size for f in cache_dir.glob("*") if f.is_file())
    cold, warm = data.get("cold") or {}, data.get("warm") or {}
    ratio = warm["warmup_s"] / cold["warmup_s"] if cold.get("warmup_s") and warm.get("warmup_s") else None
    same = data.get("bit_identical")
    targets = [
        Target(
            "warm restart: second warm-up / first",
            ratio,
            0.25,
            "x",
            detail=f"{warm.get('warmup_s')} s vs {cold.get('warmup_s')} s",
        ),
        Target(
            "warm restart: outputs bit-identical (1 = yes)",
            None if same is None else float(all(same.values())),
            1.0,
            higher=True,
        ),
    ]
    data["targets"] = [t.as_dict() for t in targets]
    report.save()
    for label in ("cold", "warm"):
        run = data.get(label) or {}
        print(
            f"{label}: warm-up {run.get('warmup_s')} s, model build {run.get('model_build_s')} s, "
            f"cache {run.get('artifact_cache')}, compiles {run.get('compiles')}"
        )
    if args.compiler == "eager":
        print(
            "\nthe eager compiler leaves inductor nothing to save: both processes miss the cache by design "
            "(--smoke --compiler inductor checks the cache on the CPU, in about a minute)"
        )
    print(f"\nwrote {path}\n")
    print(targets_table(targets))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", help="JSON path (default $OUT/restart.json)")
    parser.add_argument("--compiler", help="full's compiler (default: inductor; eager with --smoke)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--logits", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.compiler = args.compiler or ("eager" if args.smoke else "inductor")
    if not start(args.smoke):
        return 2
    if args.child:
        with torch.no_grad():
            result = child(args)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
