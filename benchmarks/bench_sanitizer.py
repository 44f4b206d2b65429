"""What the sanitizer costs per step: a decode replay of the reference model at batch 1 with the address
guard off, with the guard but the value checks off (``DEVGRAPH_SANITIZE=0``), and with both (the default),
plus the per-step check alone, timed in isolation (issue 32's target: at most 1% of the replay).

    python benchmarks/bench_sanitizer.py                      # GPU: qwen3-0.6b preset, bf16, context 512
    python benchmarks/bench_sanitizer.py --device cpu         # the whole script on the CPU (tiny preset)

The forward is the reference model's ``decode_step`` behind a wrapper that reads four host values from the
forward context, as an engine's attention metadata would (``max_seqlen``, ``num_seqs``, ...): the
sanitizer records them at capture and compares them before each replay, so the measured check includes
value comparisons, not only the address guard's event counter. In the same run: the three runners'
outputs are compared with each other and with eager, and a replay whose context changed one value must be
refused with the sanitizer on (and replays stale with it off).

Writes ``$OUT/sanitizer.json`` (or ``--out``; default
``benchmarks/results/<h100|h200|gpu|cpu>-sanitizer.json``) and a PNG beside it: the device, torch, the
command, per runner the median latency (CUDA events) and host time per step, and the isolated check's
median microseconds, with the share of the replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import devgraph
from devgraph.errors import ReplayError
from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch, reference_inputs


@dataclasses.dataclass
class StepMeta:
    """Host-side metadata an engine hands to each step through the forward context."""

    max_seqlen: int
    num_seqs: int
    block_size: int
    num_decode_tokens: int


def _decode_forward(model: ReferenceModel) -> Any:
    def forward(**inputs: torch.Tensor) -> torch.Tensor:
        meta = devgraph.get_forward_context()
        if meta is not None:  # read as an attention backend reads its launch arguments (values unused)
            _ = (meta.max_seqlen, meta.num_seqs, meta.block_size, meta.num_decode_tokens)
        return model.decode_step(**inputs)

    forward.__signature__ = inspect.signature(model.decode_step)  # type: ignore[attr-defined]
    return forward


def _runner(model: ReferenceModel, meta: StepMeta, *, guard: bool, values: bool) -> devgraph.GraphRunner:
    previous = os.environ.get("DEVGRAPH_SANITIZE")
    os.environ["DEVGRAPH_SANITIZE"] = "1" if values else "0"  # read when the runner's guard is made
    try:
        runner = devgraph.GraphRunner(
            _decode_forward(model),
            phase="decode",
            inputs=reference_inputs(model, "decode"),
            sizes=[1],
            device=model.device,
            mode="full",
            address_guard=guard,
            capture_context=lambda key: meta,
            progress=False,
        )
        runner.capture()
    finally:
        if previous is None:
            os.environ.pop("DEVGRAPH_SANITIZE", None)
        else:
            os.environ["DEVGRAPH_SANITIZE"] = previous
    return runner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_step(device: torch.device, step: Any) -> tuple[float, float]:
    """``(latency µs, host µs)`` of one step on an idle device: CUDA events from the host starting it to
    its last kernel, and the host's time until it returns."""
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        step()
        us = (time.perf_counter() - t0) * 1e6
        return us, us
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    step()
    host = (time.perf_counter() - t0) * 1e6
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3, host


def _check_us(check: Any, iters: int) -> float:
    """Median host microseconds of one guard check (no device work: nothing to synchronize)."""
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        check()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared host: more threads make the CPU replay's time noise
    preset = "tiny" if device.type == "cpu" else "qwen3-0.6b"
    config = ReferenceConfig.preset(preset, max_seq_len=1024)
    model = ReferenceModel(config, device=device, seed=0)
    model.randomize_cache(seed=0)
    batch = make_decode_batch(model, 1, seq_lens=args.context)
    meta = StepMeta(max_seqlen=args.context, num_seqs=1, block_size=16, num_decode_tokens=1)
    runners = {
        "no_guard": _runner(model, meta, guard=False, values=False),
        "guard_only": _runner(model, meta, guard=True, values=False),
        "sanitizer": _runner(model, meta, guard=True, values=True),
    }
    with torch.no_grad():
        eager = model.decode_step(**batch).float()
    outputs = {name: r.run(**batch, context=meta, copy=True).float() for name, r in runners.items()}
    max_diff = {name: float((out - eager).abs().max()) for name, out in outputs.items()}
    # Graph vs eager: 16-bit kernels at one row may round differently (the suite's 2e-2 of max |eager|).
    same = max(max_diff.values()) <= 2e-2 * max(1.0, float(eager.abs().max()))
    # A step whose metadata changed one value: refused with the sanitizer on, replayed stale with it off.
    changed = dataclasses.replace(meta, max_seqlen=args.context + 64)
    try:
        runners["sanitizer"].run(**batch, context=changed)
        caught = False
    except ReplayError:
        caught = True
    stale_without = True
    try:
        runners["guard_only"].run(**batch, context=changed)
    except ReplayError:
        stale_without = False

    for runner in runners.values():  # warm every path before timing
        for _ in range(20):
            runner.run(**batch, context=meta)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for _ in range(args.iters):  # interleaved rounds: drift hits every runner alike
        for name, runner in runners.items():
            samples[name].append(_time_step(device, lambda r=runner: r.run(**batch, context=meta)))
    steps = {
        name: {
            "latency_us": statistics.median(lat for lat, _ in taken),
            "host_us": statistics.median(host for _, host in taken),
        }
        for name, taken in samples.items()
    }
    sanitizer = runners["sanitizer"]
    guard = sanitizer.life.guard  # the per-step check the runner calls before each replay
    key = sanitizer.keys[0]
    check = {
        "whole_check_us": _check_us(lambda: guard.check(key, meta), args.iters * 5),
        "address_part_us": _check_us(guard.check_addresses, args.iters * 5),
        "values_part_us": _check_us(lambda: guard.values.check(key, meta), args.iters * 5),
        "values_without_context_us": _check_us(lambda: guard.values.check(key, None), args.iters * 5),
    }
    values_read = guard.values.describe()["values"]
    replay_us = steps["guard_only"]["latency_us"]
    share = 100.0 * check["values_part_us"] / replay_us
    whole_share = 100.0 * check["whole_check_us"] / steps["no_guard"]["latency_us"]
    for runner in runners.values():
        runner.close()
    return {
        "benchmark": "sanitizer cost per decode replay, reference model, batch 1",
        "label": (
            "CPU simulator, one thread, a shared 2-core host: the replay is the simulator's, not a device's"
            if device.type == "cpu"
            else "decode graph replay (full) at batch 1; CUDA-event latency, interleaved rounds"
        ),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "devgraph": devgraph.__version__,
        "command": " ".join(["python", *map(shlex.quote, sys.argv)]),
        "preset": preset,
        "dtype": str(config.dtype),
        "context": args.context,
        "iters": args.iters,
        "values_read_per_step": values_read,
        "steps": steps,
        "check": check,
        "sanitizer_share_of_replay_pct": share,
        "guard_and_sanitizer_share_of_replay_pct": whole_share,
        "end_to_end_delta_pct": 100.0
        * (steps["sanitizer"]["latency_us"] - steps["guard_only"]["latency_us"])
        / replay_us,
        "target_pct": 1.0,
        "meets_target": share <= 1.0,
        "correctness": {
            "max_abs_diff_vs_eager": max_diff,
            "graphs_match_eager": same,
            "changed_value_refused": caught,
            "changed_value_replayed_stale_without_sanitizer": stale_without,
        },
    }


def _plot(report: dict[str, Any], target: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(report["steps"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [report["steps"][n]["latency_us"] for n in names], color=["#999", "#69c", "#c63"])
    left.set_ylabel("decode step latency, µs (median)")
    left.set_title(f"batch 1, {report['preset']}, {report['device']}")
    parts = ["address_part_us", "values_part_us", "whole_check_us"]
    right.bar(["address", "values", "whole"], [report["check"][p] for p in parts], color="#c63")
    right.set_ylabel("per-step check alone, µs (median)")
    right.set_title(f"values: {report['sanitizer_share_of_replay_pct']:.3f}% of the replay (target 1%)")
    fig.tight_layout()
    fig.savefig(target.with_suffix(".png"), dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device is None:
        print("no CUDA GPU here; pass --device cpu to run the script on the CPU", file=sys.stderr)
        return 2
    report = measure(args)
    if args.out:
        target = Path(args.out)
    elif os.environ.get("OUT"):
        target = Path(os.environ["OUT"]) / "sanitizer.json"
    else:
        name = report["device"]
        gpu = "h100" if "H100" in name else "h200" if "H200" in name else "gpu"
        tag = gpu if args.device != "cpu" else "cpu"
        target = Path(__file__).parent / "results" / f"{tag}-sanitizer.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1) + "\n")
    _plot(report, target)
    ok = report["correctness"]
    print(
        f"replay {report['steps']['guard_only']['latency_us']:.1f} us; value check "
        f"{report['check']['values_part_us']:.2f} us = {report['sanitizer_share_of_replay_pct']:.3f}% "
        f"(target 1%); whole guard check {report['check']['whole_check_us']:.2f} us; changed value refused: "
        f"{ok['changed_value_refused']}; graphs match eager: {ok['graphs_match_eager']}; wrote {target}"
    )
    return 0 if ok["changed_value_refused"] and ok["graphs_match_eager"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
