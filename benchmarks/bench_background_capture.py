"""Serving before the graphs are ready: seconds from the weights loaded to the first response, graphs
captured up front against captured in the background (one key between two engine steps), and the tokens
across the switch from eager steps to graphs in deterministic mode.

    python benchmarks/bench_background_capture.py --out $OUT/background_capture.json   # GPU, <= 8 min
    python benchmarks/bench_background_capture.py --smoke                             # the script on the CPU

The reference model at the Qwen3-0.6B shape (bf16, paged attention, seeded weights), built once; then per
repeat a fresh :class:`~devgraph.serve.engine.Engine` and :class:`~devgraph.serve.engine.EngineLoop` (the
server's engine thread) with the serving defaults on a GPU (32 running requests, 2048-token budget, a size
ladder per phase), one 128-token prompt submitted at once. ``up_front``: the engine captures every key,
then serves. ``background``: the engine serves at once and captures one key between two steps and while
idle. Measured: weights loaded -> first token, -> last key captured, and eager steps meanwhile. The first
repeat of each mode follows an untimed eager request, so CUDA's and cuBLAS's first-use costs fall on
neither. Deterministic mode: 8 prompts x 24 tokens, graphs captured up front against the first 4 steps
before any graph (then one key per step): tokens equal, counted. Targets: first response <= 1 s in the
background mode; tokens equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from harness.device import Budget, Device, start
from harness.plots import Panel, plot_panels
from harness.report import Report, environment, output_path
from harness.targets import Target, targets_table

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, EngineLoop, SamplingParams

log = logging.getLogger("bench_background_capture")

PROMPT = 128
MODES = ("up_front", "background")


def _model(smoke: bool, device: torch.device) -> tuple[ReferenceModel, float]:
    start = time.perf_counter()
    if smoke:
        config = ReferenceConfig.preset("tiny", num_layers=1, max_requests=8)
    else:
        config = ReferenceConfig.preset("qwen3-0.6b", max_requests=32, max_seq_len=1024)
    model = ReferenceModel(config, device=device, seed=0)
    Device(device).sync()
    return model, time.perf_counter() - start


def _engine_config(smoke: bool, deterministic: bool = False) -> EngineConfig:
    if deterministic:
        return EngineConfig(8, 64 if smoke else 256, deterministic=True)
    return EngineConfig(8, 64) if smoke else EngineConfig(32, 2048)


def one_start(model: ReferenceModel, mode: str, graphs: str, smoke: bool) -> dict[str, Any]:
    """One engine from the weights loaded to the first token (and to the last key captured)."""
    dev = Device(model.device)
    dev.settle()
    t0 = time.perf_counter()
    background = mode == "background"
    engine = Engine(
        model, _engine_config(smoke), device_graph_mode=graphs, progress=False, capture=not background
    )
    capture = engine.capture_in_background() if background else None
    built = time.perf_counter() - t0
    loop = EngineLoop(engine)
    first = threading.Event()
    finished = threading.Event()
    times: dict[str, float] = {}

    def sink(output: Any) -> None:
        if "first" not in times:
            times["first"] = time.perf_counter() - t0
            first.set()
        if output.finished:
            finished.set()

    loop.start()
    prompt = [(7 * i) % model.config.vocab_size for i in range(PROMPT)]
    loop.submit(prompt, SamplingParams(max_tokens=16), sink)
    first.wait(300)
    finished.wait(300)
    while capture is not None and not capture.done:
        time.sleep(0.01)
    ready = time.perf_counter() - t0
    stats = loop.stats()
    loop.shutdown(0.0)
    engine.close()
    eager = {p: r["eager_by_reason"].get("capturing", 0) for p, r in stats["runners"].items()}
    keys = capture.total if capture is not None else None
    return {
        "mode": mode,
        "engine_built_s": round(built, 4),
        "first_response_s": round(times.get("first", float("nan")), 4),
        "all_graphs_s": round(ready, 4),
        "keys": keys,
        "eager_steps_while_capturing": eager,
        "capture_error": None if capture is None else capture.error and str(capture.error),
    }


def deterministic_switch(model: ReferenceModel, graphs: str, smoke: bool) -> dict[str, Any]:
    """Tokens of 8 prompts: graphs up front against eager first steps, then one key per step."""
    config = _engine_config(smoke, deterministic=True)
    rng = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, model.config.vocab_size, (int(n),), generator=rng).tolist()
        for n in torch.randint(4, 100, (8,), generator=rng)
    ]
    params = SamplingParams(max_tokens=24)
    ahead = Engine(model, config, device_graph_mode=graphs, progress=False)
    expected = ahead.generate(prompts, params)
    ahead.close()
    engine = Engine(model, config, device_graph_mode=graphs, progress=False, capture=False)
    background = engine.capture_in_background()
    requests = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps >= 4:
            background.step()
    got = [list(r.output) for r in requests]
    runners = engine.stats()["runners"]
    engine.close()
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    return {
        "prompts": len(prompts),
        "tokens_per_prompt": params.max_tokens,
        "prompts_equal": same,
        "all_equal": same == len(prompts),
        "eager_steps_while_capturing": {p: r["eager_by_reason"]["capturing"] for p, r in runners.items()},
        "replays_after_the_switch": {p: r["replays"] for p, r in runners.items()},
    }


def _median(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in runs if r.get(field) == r.get(field)]
    return round(statistics.median(values), 4) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", help="JSON path (default $OUT/background_capture.json); the PNG beside it")
    parser.add_argument("--graphs", default="auto", help="--device-graph-mode value (default auto)")
    parser.add_argument("--repeats", type=int, default=3, help="starts per mode (default 3)")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds (default 420)")
    args = parser.parse_args(argv)
    if not start(args.smoke):
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        torch.set_num_threads(1)
    budget = Budget(args.time_budget)
    path = output_path(
        "background_capture.json", "benchmarks/results/background_capture.json", args.out, args.smoke
    )
    report = Report(path, environment(Device(device)))
    data = report.data
    model, weights_s = _model(args.smoke, device)
    data["model"] = {"preset": "tiny" if args.smoke else "qwen3-0.6b", "weights_s": round(weights_s, 3)}
    data["graphs"] = args.graphs
    warm = Engine(model, _engine_config(args.smoke), device_graph_mode="disabled", progress=False)
    warm.generate([[1] * PROMPT], SamplingParams(max_tokens=2))  # first-use costs, untimed
    warm.close()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            estimate = 3 * max((r["all_graphs_s"] for r in runs[mode]), default=30.0)
            if repeat and not budget.allows(estimate):
                log.warning("time budget: stopping after %d repeat(s)", repeat)
                break
            try:
                runs[mode].append(one_start(model, mode, args.graphs, args.smoke))
                log.info("%s", runs[mode][-1])
            except Exception as exc:
                report.error(f"{mode} start {repeat}", exc)
            data["starts"] = runs
            report.save()
    summary = {
        m: {f: _median(runs[m], f) for f in ("first_response_s", "all_graphs_s", "engine_built_s")}
        for m in MODES
    }
    data["medians"] = summary
    try:
        data["deterministic_switch"] = deterministic_switch(model, args.graphs, args.smoke)
    except Exception as exc:
        report.error("deterministic switch", exc)
    switch = data.get("deterministic_switch") or {}
    targets = [
        Target(
            "background: weights loaded -> first response",
            summary["background"]["first_response_s"],
            1.0,  # issue 31: the first response within 1 s of the weights, by default
            " s",
        ),
        Target(
            "tokens equal across the switch (1 = yes)", float(bool(switch.get("all_equal"))), 1.0, higher=True
        ),
    ]
    data["targets"] = [t.as_dict() for t in targets]
    report.save()
    panel = Panel(
        "weights loaded -> (median of starts)",
        ["first response", "all graphs captured"],
        {m: [summary[m]["first_response_s"], summary[m]["all_graphs_s"]] for m in MODES},
        ylabel="seconds",
        bars=True,
        reference={"target 1 s": [1.0, None]},
    )
    if importlib.util.find_spec("matplotlib") is None:
        log.warning("matplotlib is not installed: no PNG")
    else:
        plot_panels(
            path.with_suffix(".png"),
            [panel],
            f"serving before the graphs are ready ({Device(device).name()})",
        )
    print(f"medians: {summary}\nswitch: {switch}\nwrote {path}\n")
    print(targets_table(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
