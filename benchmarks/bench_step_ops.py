"""The torch ops the serving engine issues per steady-state decode step outside the graph replay.

On a GPU each op issued around the replay (staging the step's inputs, the pending ids, sampling, the
sampled tokens into their slots, the copies back) costs a launch of host time; on a fast model that host
time is the inter-token latency's host share. This script serves ``--batches`` greedy requests at once
on the ``tiny`` reference model (graphs captured: simulated on the CPU), lets them reach steady-state
decode, then counts every aten op of ``--steps`` decode steps with
:class:`~devgraph.serve.engine.step_ops.StepOps`, per step phase, minus the replay's own ops. The counts
do not depend on the machine's speed: they are the same on any CPU, and ``--device cuda`` counts the same
on a GPU (where the message's copy and the copies back are real host <-> device copies).

    python3 benchmarks/bench_step_ops.py                    # CPU: benchmarks/results/cpu-step-ops.json
    python3 benchmarks/bench_step_ops.py --device cuda      # GPU: $OUT/step-ops.json
    python3 benchmarks/bench_step_ops.py --before OLD.json  # keeps OLD.json's totals beside the new ones

``device_ops``: kernels of the device phases (a launch each on a GPU); ``host_kernels``: kernels on
host tensors; ``ops``: every op, views and allocations included; ``copies``: host <-> device copies;
``events``: device events recorded. A step that crosses a KV-block boundary allocates a block (a write
into the block tables); the report gives the most common step and the largest. On the CPU the message
crosses by no copy (its views are the inputs) and the copies back are clones: a GPU counts one more device
op, the message's copy. ``host_us_outside_replay``: a step's host time minus its replay call, timed
after the counting with the counting mode off (noisy on a shared CPU: the op counts are the measure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams
from devgraph.serve.engine.step_ops import PHASES, StepCount, StepOps

SUMMARY = ("device_ops", "host_kernels", "ops", "copies", "events")


def host_time(engine: Engine, steps: int) -> dict[str, float] | None:
    """Host microseconds of a decode step outside the replay (the step's wall time minus the replay's
    call), median and best over ``steps`` steps, no counting mode on; ``None`` for 0 steps. On a GPU the
    replay call returns once the graph is queued, so this is the host's whole share there; on the CPU the
    simulated replay runs the graph's ops, which is why it is left out."""
    if steps <= 0:
        return None
    spent = [0.0]
    undo = []
    for graphs in engine.decode_runner.life.sets.all:
        backend = graphs.backend
        replay = backend.replay

        def timed(*args: Any, _replay: Any = replay, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _replay(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        backend.replay = timed
        undo.append(backend)
    samples = []
    try:
        for _ in range(steps):
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step()
            samples.append((time.perf_counter() - start - spent[0]) * 1e6)
    finally:
        for backend in undo:
            del backend.replay
    return {"median": round(statistics.median(samples), 1), "best": round(min(samples), 1)}


@contextlib.contextmanager
def without_static_rows() -> Iterator[None]:
    """The engine's step as it was before its ids and block tables were written into the runner's static
    rows (``GraphRunner.static_rows``): the runner copies them in, two device copies more a step."""
    from devgraph.runner.graph_runner import GraphRunner

    rows = GraphRunner.static_rows
    GraphRunner.static_rows = lambda self, name, rows: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        GraphRunner.static_rows = rows  # type: ignore[method-assign]


def count(
    batch: int,
    device: str,
    steps: int,
    scheduler: str,
    time_steps: int = 0,
    *,
    preset: str = "tiny",
    dtype: str = "float32",
    timeline: int = 0,
) -> dict[str, Any]:
    """Serve ``batch`` greedy requests; the op counts of ``steps`` decode steps once every request decodes
    (then ``time_steps`` timed on the host, then ``timeline`` profiled on a GPU)."""
    config = ReferenceConfig.preset(preset, max_requests=max(batch, 1), dtype=dtype)
    model = ReferenceModel(config, seed=0, device=device)
    engine = Engine(
        model,
        EngineConfig(max_running_requests=batch, token_budget=max(batch, 64), scheduler=scheduler),
        device_graph_mode="auto",
        progress=False,
    )
    warm = 4
    params = SamplingParams(max_tokens=warm + steps + time_steps + 2 * (timeline + 1) + 8, temperature=0)
    for i in range(batch):
        engine.add_request([(i * 7 + j) % config.vocab_size for j in range(5)], params)
    for _ in range(64):  # until the prompts are in and a few decode steps ran
        before = engine.step_counts.copy()
        engine.step()
        if engine.step_counts - before == Counter(decode=1) and engine.num_running == batch:
            warm -= 1
            if warm == 0:
                break
    else:
        raise RuntimeError(f"batch {batch}: no steady decode after 64 steps ({dict(engine.step_counts)})")
    counted: list[StepCount] = []
    with StepOps(engine) as ops:
        for _ in range(steps):
            before = engine.step_counts.copy()
            engine.step()
            if engine.step_counts - before != Counter(decode=1):
                raise RuntimeError(f"batch {batch}: a counted step was not one decode forward")
    counted = ops.steps
    host_us = host_time(engine, time_steps)
    gaps = plain_gaps = None
    if timeline > 0:
        from harness.profile import replay_gaps  # the GPU's profile only (benchmarks/ on the path)

        gaps = replay_gaps(engine.step, timeline)
        with without_static_rows():  # the same engine with the runner's copies, in turn: the difference
            plain_gaps = replay_gaps(engine.step, timeline)
    replays = engine.decode_runner.stats()["replays"]
    engine.close()
    dicts = [c.as_dict() for c in counted]
    signature = Counter(json.dumps(d, sort_keys=True) for d in dicts)
    typical = json.loads(signature.most_common(1)[0][0])
    largest = max(dicts, key=lambda d: (d["ops"], d["device_ops"]))
    return {
        "batch": batch,
        "steps_counted": len(dicts),
        "steps_like_typical": signature.most_common(1)[0][1],
        "decode_replays": replays,
        "host_us_outside_replay": host_us,
        "between_replays": gaps,
        "between_replays_without_static_rows": plain_gaps,
        **{name: typical[name] for name in SUMMARY},
        "max": {name: largest[name] for name in SUMMARY},
        "typical_step": typical,
        "largest_step": largest if largest != typical else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="default: 1 32")
    parser.add_argument("--steps", type=int, default=20, help="decode steps counted per batch (default 20)")
    parser.add_argument("--scheduler", default="overlap", choices=["overlap", "serial"])
    parser.add_argument(
        "--time-steps", type=int, default=40, help="decode steps timed after counting (default 40; 0: none)"
    )
    parser.add_argument("--preset", default="tiny", help="the reference model's preset (default tiny)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (default float32)")
    parser.add_argument(
        "--timeline",
        type=int,
        default=0,
        help="GPU: profile this many decode steps and report what the device runs between replays",
    )
    parser.add_argument("--out", help="JSON path (default: $OUT/step-ops.json on a GPU, else results/)")
    parser.add_argument("--before", help="an earlier report of this script: its totals go in as 'before'")
    args = parser.parse_args(argv)
    if args.timeline and args.device == "cpu":
        parser.error("--timeline profiles a GPU's device timeline: add --device cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU here; count on the CPU (the default)", file=sys.stderr)
        return 2
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    default = "benchmarks/results/cpu-step-ops.json"
    if args.device != "cpu":
        default = str(Path(os.environ.get("OUT", "benchmarks/results")) / "step-ops.json")
    path = Path(args.out or default)
    report: dict[str, Any] = {
        "meta": {
            "command": "python3 benchmarks/bench_step_ops.py " + " ".join(argv or sys.argv[1:]),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
            "scheduler": args.scheduler,
            "model": f"{args.preset} reference, {args.dtype} (graphs: auto)",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "batches": {},
    }
    start = time.perf_counter()
    for batch in args.batches:
        result = count(
            batch,
            args.device,
            args.steps,
            args.scheduler,
            args.time_steps,
            preset=args.preset,
            dtype=args.dtype,
            timeline=args.timeline,
        )
        report["batches"][str(batch)] = result
        phases = result["typical_step"]["phases"]
        print(
            f"batch {batch}: per decode step outside the replay: {result['device_ops']} device ops, "
            f"{result['host_kernels']} host kernels, {result['ops']} ops in all, {result['copies']} copies, "
            f"{result['events']} events (largest step: {result['max']['ops']} ops); host time outside "
            f"the replay {result['host_us_outside_replay']} us"
        )
        for phase in sorted(phases, key=PHASES.index):
            entry = phases[phase]
            ops = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in entry["ops"].items())
            print(f"  {phase:9} {sum(entry['kinds'].values()):3} ({ops})")
        for label, gaps in (
            ("as built", result["between_replays"]),
            ("without the static rows", result["between_replays_without_static_rows"]),
        ):
            if not gaps or not gaps.get("gaps"):
                continue
            print(f"  {label}:")
            print(
                f"  between replays (median of {gaps['gaps']}): {gaps['gap_us_median']} us, device busy "
                f"{gaps['busy_us_median']} us in {gaps['ops_per_gap_median']} ops, "
                f"idle {gaps['idle_us_median']} us; replay {gaps['replay_us_median']} us, launched "
                f"{gaps['replay_lead_us_median']} us before it started"
            )
            for name, entry in gaps["by_op"].items():
                print(
                    f"    {entry['per_gap']:>4} x {entry['us_median']:7.2f} us (launched "
                    f"{entry['lead_us_median']} us ahead)  {name}"
                )
    if args.before:
        before = json.loads(Path(args.before).read_text())
        report["before"] = {
            "meta": before.get("meta", {}),
            "batches": {
                batch: {name: result.get(name) for name in (*SUMMARY, "max", "host_us_outside_replay")}
                for batch, result in before.get("batches", {}).items()
            },
        }
    report["meta"]["seconds"] = round(time.perf_counter() - start, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path} ({report['meta']['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
