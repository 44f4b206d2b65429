"""The vendor-neutral ``accelerator`` platform (``torch.accelerator.Graph``) against the CUDA plug-in's
``full`` on the reference model's decode step: replay time per batch size, and outputs bit for bit the same.

    python benchmarks/bench_accelerator.py          # GPU, about a minute on an H100: $OUT/accelerator.json
    python benchmarks/bench_accelerator.py --smoke  # the script on the CPU (both arms on the cpu simulator)

Model: ``devgraph.reference`` preset ``qwen3-0.6b`` (28 layers, bf16, random weights, ``paged`` attention),
paged KV cache of random values; decode at batch 1/8/32/64 with 512 tokens of context, each batch writing
blocks no other batch reads (``harness.cases.KVPlan``), so one eager output per batch is every arm's
reference. Arms, each a ``full`` backend over the same model with the same captured sizes:

* ``cuda_full``: ``devgraph_cuda``'s ``CudaFullGraphBackend`` on ``CudaPlatform`` (``torch.cuda.CUDAGraph``);
* ``accel_full``: devgraph's ``FullGraphBackend`` on ``AcceleratorGraphPlatform``
  (``torch.accelerator.Graph``, no vendor package). A torch without the API (the GPU image's 2.11) records
  why and times the baseline only.

Measured per batch, the arms interleaved in rounds (``harness.timing.time_cases``): ``replay``, the captured
graph alone (``backend.replay`` inside its runtime session, inputs staged once), and ``step``, a whole
``GraphRunner.run`` (staging, replay, slicing); CUDA events from the host starting the call to its last
kernel, median of the steps. Targets: the accelerator's replay within 1.02x of ``cuda_full``'s at every batch,
and its outputs equal to ``cuda_full``'s bit for bit (the same kernels replayed).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from decode_bench.plan import GPU, SMOKE
from decode_bench.setup import Setup, build_setup
from harness.device import Device, start
from harness.plots import Panel, plot_panels
from harness.report import Report, diff, environment, output_path
from harness.targets import Target, targets_table
from harness.timing import Variant, measure_build, time_cases

from devgraph import GraphRunner
from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.platform import GraphPlatform
from devgraph.platforms.accelerator import AcceleratorGraphPlatform, missing_api
from devgraph.platforms.sim.platform import CpuSimPlatform
from devgraph.reference import decode_runner
from devgraph.strategies import FullGraphBackend

ROOT = Path(__file__).resolve().parents[1]
PLANS = {
    "gpu": dataclasses.replace(GPU, decode_batches=(1, 8, 32, 64), contexts=(512,), iters=200, rounds=4),
    "smoke": dataclasses.replace(SMOKE, decode_batches=(1, 4), contexts=(40,), iters=4, rounds=2),
}
RATIO_LIMIT = 1.02


def baseline_arm(smoke: bool) -> tuple[str, GraphPlatform, type[DeviceGraphBackend]]:
    """The CUDA plug-in's ``full`` (from the checkout when it is not installed); on ``--smoke`` the CPU's."""
    if smoke:
        return "cpu_full", CpuSimPlatform(), FullGraphBackend
    try:
        import devgraph_cuda  # noqa: F401
    except ImportError:
        sys.path.append(str(ROOT / "backends" / "cuda"))
    from devgraph_cuda.backends import CudaFullGraphBackend
    from devgraph_cuda.platform import CudaPlatform

    return "cuda_full", CudaPlatform(), CudaFullGraphBackend


def runner_arm(setup: Setup, name: str, backend: DeviceGraphBackend) -> Variant:
    """A captured decode runner over ``backend``: a ``step`` (``run``) and a ``replay`` (the graph alone)."""
    model = setup.paged
    runner, seconds, nbytes = measure_build(
        setup.dev,
        lambda: _captured(decode_runner(model, sizes=list(setup.plan.decode_batches), backend=backend)),
    )
    batches = setup.batches["decode"]
    keys = {key.tokens: key for key in backend.captured_keys()}

    def step(case: str) -> Any:
        kind, _, batch = case.partition(":")
        if kind == "step":
            return runner.run(**batches[batch])
        with backend.runtime_session():
            return backend.replay(keys[int(batch[1:].split("@")[0])], runner.static_inputs)

    for batch in batches.values():  # stage every batch once so a replay-only step reads a real batch
        runner.run(**batch)
    info = {"platform": backend.platform.name, "capture_s": round(seconds, 3), "graph_bytes": nbytes}
    return Variant(name, step, info, runner.close, runner)


def _captured(runner: GraphRunner) -> GraphRunner:
    runner.capture()
    return runner


def check_outputs(setup: Setup, arms: Sequence[Variant]) -> dict[str, Any]:
    """Each arm's output per batch against eager; the accelerator's against the baseline's, bit for bit."""
    out: dict[str, Any] = {}
    outputs = {}
    for arm in arms:
        outputs[arm.name] = {
            case: arm.runner.run(**batch).clone() for case, batch in setup.batches["decode"].items()
        }
        refs = setup.refs["decode"]["paged"]
        out[arm.name] = {case: diff(o, refs[case]) for case, o in outputs[arm.name].items()}
    if len(arms) == 2:
        base, accel = (outputs[a.name] for a in arms)
        out["accel_equals_baseline"] = all(torch.equal(base[c], accel[c]) for c in base)
    return out


def measure(args: argparse.Namespace, report: Report) -> None:
    plan = PLANS["smoke" if args.smoke else "gpu"]
    device = torch.device("cpu" if args.smoke else "cuda")
    setup = build_setup(plan, device, phases=("decode",))
    name, platform, backend_cls = baseline_arm(args.smoke)
    arms = [runner_arm(setup, name, backend_cls(platform, phase="decode"))]
    accelerator = AcceleratorGraphPlatform()
    availability = accelerator.availability()
    report.data["accelerator"] = {
        "usable": availability.usable,
        "reason": availability.reason,
        "missing_api": missing_api(),
        "has_generate_graph_pool_handle": hasattr(torch.accelerator, "generate_graph_pool_handle"),
    }
    if availability:
        arms.append(runner_arm(setup, "accel_full", FullGraphBackend(accelerator, phase="decode")))
    elif args.smoke:  # the comparison's code on the CPU: a second cpu arm stands in for the accelerator's
        arms.append(
            runner_arm(setup, "accel_full_standin", FullGraphBackend(CpuSimPlatform(), phase="decode"))
        )
    try:
        report.data["arms"] = {a.name: a.info for a in arms}
        report.data["correctness"] = check_outputs(setup, arms)
        cases = [f"{kind}:{c}" for kind in ("replay", "step") for c in setup.batches["decode"]]
        report.data["latency"] = time_cases(
            arms, cases, setup.dev, iters=plan.iters, rounds=plan.rounds, on_error=report.error
        )
    finally:
        for arm in arms:
            arm.close()
    # Ratios of the accelerator arm only: a stand-in's would read as a measurement of the platform.
    key = "ratios" if arms[-1].name == "accel_full" else "standin_ratios"
    report.data[key] = _ratios(report.data["latency"], [a.name for a in arms])


def _ratios(latency: dict[str, Any], names: list[str]) -> dict[str, float]:
    if len(names) < 2:
        return {}
    base, accel = (latency[n] for n in names)
    return {c: round(accel[c]["ms"] / base[c]["ms"], 4) for c in base if c in accel and base[c]["ms"] > 0}


def targets(data: dict[str, Any]) -> list[Target]:
    replay = [r for c, r in data.get("ratios", {}).items() if c.startswith("replay:")]
    equal = data.get("correctness", {}).get("accel_equals_baseline") if "ratios" in data else None
    return [
        Target(
            "accelerator replay / cuda full replay (worst batch)",
            max(replay) if replay else None,
            RATIO_LIMIT,
            "x",
        ),
        Target(
            "accelerator outputs equal cuda full's (1 = yes)",
            None if equal is None else float(equal),
            1,
            "",
            True,
        ),
    ]


def plot(data: dict[str, Any], path: Path) -> None:
    latency = data.get("latency", {})
    panels = []
    for kind in ("replay", "step"):
        cases = [c for c in next(iter(latency.values()), {}) if c.startswith(f"{kind}:")]
        series = {name: [per.get(c, {}).get("ms") for c in cases] for name, per in latency.items()}
        panels.append(
            Panel(f"decode {kind} (qwen3-0.6b shape)", [c.split(":")[1] for c in cases], series, bars=True)
        )
    plot_panels(path, panels, "accelerator (torch.accelerator.Graph) vs cuda full")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (simulated graphs)")
    parser.add_argument("--out", help="JSON path (default $OUT/accelerator.json, else benchmarks/results/)")
    args = parser.parse_args(argv)
    if not start(args.smoke):
        return 2
    path = output_path("accelerator.json", "benchmarks/results/h100-accelerator.json", args.out, args.smoke)
    report = Report(path, environment(Device("cpu" if args.smoke else "cuda")))
    try:
        with torch.no_grad():
            measure(args, report)
    except Exception as exc:
        report.error("benchmark", exc)
    found = targets(report.data)
    report.data["targets"] = [t.as_dict() for t in found]
    report.save()
    failed = bool(report.data["errors"])
    try:
        plot(report.data, path.with_suffix(".png"))
    except Exception as exc:
        report.error("plot", exc)
        report.save()
    accel = report.data.get("accelerator", {})
    if not accel.get("usable"):
        print(f"accelerator arm not run: {accel.get('reason')}")
    else:
        print(f"replay and step ratios (accelerator / cuda full): {report.data.get('ratios')}")
    if args.smoke:
        print("--smoke: both arms ran on the CPU simulator; its timings say nothing about a GPU")
    print(f"wrote {path}\n\n{targets_table(found)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
