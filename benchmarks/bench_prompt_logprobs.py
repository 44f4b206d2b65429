"""Prompt log-probabilities against a plain prefill: what ``echo`` with ``logprobs`` (lm-eval's
log-likelihood requests) costs over computing the same prompt without them.

    python benchmarks/bench_prompt_logprobs.py --out benchmarks/results/prompt_logprobs_h100.json  # GPU
    python benchmarks/bench_prompt_logprobs.py --smoke                                # the CPU, tiny

The reference model at the Qwen3-0.6B shape (bf16, seeded weights; vocabulary 151936) in a serving
:class:`~devgraph.serve.engine.Engine` with graphs (``--graphs``, default ``auto``), a 512-token budget so
the prompt is one prefill step. One request of a 512-token prompt with ``max_tokens=0``, timed from
``add_request`` to its finish (device synchronised): ``plain`` (the prompt only) and ``prompt_logprobs``
(``prompt_logprobs=1``: the LM head over the 511 scored rows after the graph, log-softmax, top-1 and the
rank, one host copy), taking turns over the rounds. Target: ``prompt_logprobs`` <= 1.2x ``plain``
(medians). Correctness in the same run: the engine's prompt log-probabilities against the log-softmax of
one eager whole-prompt forward (``verify_step``) of the same weights (max |difference|; bf16 within 5e-2,
float32 within 1e-4).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from harness.device import Device, start
from harness.report import Report, environment, output_path

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams

log = logging.getLogger("bench_prompt_logprobs")


def _config(smoke: bool) -> tuple[ReferenceConfig, int]:
    if smoke:
        return ReferenceConfig.preset("tiny", dtype="float32", max_requests=8), 64
    return ReferenceConfig.preset("qwen3-0.6b", max_requests=8), 512


def _time_request(
    engine: Engine, dev: Device, prompt: list[int], params: SamplingParams
) -> tuple[float, object]:
    dev.sync()
    start_time = time.perf_counter()
    request = engine.add_request(prompt, params)
    while engine.has_work:
        engine.step()
    dev.sync()
    return (time.perf_counter() - start_time) * 1e3, request


def _profile(
    engine: Engine, dev: Device, prompt: list[int], params: SamplingParams, device: torch.device
) -> dict[str, list[dict[str, object]]]:
    """Where one request's time goes: the ops with the most self time on the host and on the device."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _time_request(engine, dev, prompt, params)
    events = prof.key_averages()

    def top(attribute: str) -> list[dict[str, object]]:
        ranked = sorted(events, key=lambda e: getattr(e, attribute, 0.0), reverse=True)[:10]
        return [
            {"op": e.key, "calls": e.count, "self_us": round(float(getattr(e, attribute, 0.0)), 1)}
            for e in ranked
        ]

    device_attribute = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return {"host": top("self_cpu_time_total"), "device": top(device_attribute)}


def _reference(config: ReferenceConfig, device: torch.device, prompt: list[int]) -> torch.Tensor:
    """log_softmax of every prompt row from one eager forward of the whole prompt (fresh cache)."""
    model = ReferenceModel(config, device, seed=0)
    block = config.block_size
    blocks = -(-len(prompt) // block)
    tables = torch.zeros((1, config.max_blocks_per_request), dtype=torch.int32)
    tables[0, :blocks] = torch.arange(1, blocks + 1, dtype=torch.int32)
    positions = torch.arange(len(prompt))
    slots = tables[0, positions // block].long() * block + positions % block
    with torch.no_grad():
        logits = model.verify_step(
            torch.tensor(prompt, device=device),
            positions.to(device),
            slots.to(device),
            tables.to(device),
            torch.tensor([len(prompt)], dtype=torch.int32, device=device),
            torch.tensor([0, len(prompt)], dtype=torch.int32, device=device),
        )
    return logits.float().log_softmax(-1).cpu()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU (checks the script)")
    parser.add_argument("--graphs", default="auto", help="--device-graph-mode of the engine (default auto)")
    parser.add_argument("--rounds", type=int, default=10, help="timed requests per case (default 10)")
    parser.add_argument("--out", help="the JSON report (default benchmarks/results/prompt_logprobs.json)")
    args = parser.parse_args(argv)
    if not start(args.smoke):
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    dev = Device(device)
    path = output_path(
        "prompt_logprobs.json", "benchmarks/results/prompt_logprobs.json", args.out, args.smoke
    )
    report = Report(path, environment(dev))
    config, length = _config(args.smoke)
    model = ReferenceModel(config, device, seed=0)
    engine = Engine(
        model,
        EngineConfig(max_running_requests=8, token_budget=length),
        device_graph_mode=args.graphs,
        progress=False,
    )
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()
    cases = {
        "plain": SamplingParams(max_tokens=0),
        "prompt_logprobs": SamplingParams(max_tokens=0, prompt_logprobs=1),
    }
    for params in cases.values():  # warm-up: first-use costs off the clock
        for _ in range(2):
            _time_request(engine, dev, prompt, params)
    times: dict[str, list[float]] = {name: [] for name in cases}
    scored = None
    for _ in range(args.rounds):
        for name, params in cases.items():
            ms, request = _time_request(engine, dev, prompt, params)
            times[name].append(ms)
            if name == "prompt_logprobs":
                scored = request.prompt_logprobs  # type: ignore[attr-defined]
    medians = {name: round(statistics.median(values), 4) for name, values in times.items()}
    profile = _profile(engine, dev, prompt, cases["prompt_logprobs"], device)
    ratio = medians["prompt_logprobs"] / medians["plain"]
    expected = _reference(config, device, prompt)
    assert scored is not None and len(scored) == length
    got = torch.tensor([entry.logprob for entry in scored[1:]])  # type: ignore[union-attr]
    want = expected[torch.arange(length - 1), torch.tensor(prompt[1:])]
    max_abs = float((got - want).abs().max())
    tolerance = 1e-4 if config.dtype == torch.float32 else 5e-2
    stats = engine.prefill_runner.stats()
    report.data.update(
        {
            "model": {"preset": "tiny" if args.smoke else "qwen3-0.6b", "dtype": str(config.dtype),
                      "vocab_size": config.vocab_size},
            "prompt_tokens": length,
            "graphs": args.graphs,
            "prefill_replays": stats.get("replays"),
            "median_ms": medians,
            "all_ms": {name: [round(v, 4) for v in values] for name, values in times.items()},
            "ratio": round(ratio, 4),
            "profile_of_one_prompt_logprobs_request": profile,
            "target": {"ratio_at_most": 1.2, "met": ratio <= 1.2},
            "correctness": {"max_abs_vs_whole_prompt_forward": max_abs, "tolerance": tolerance,
                            "ok": max_abs <= tolerance},
        }
    )  # fmt: skip
    report.save()
    engine.close()
    log.info(
        "medians %s ms, ratio %.3f (target <= 1.2), max |diff| %.2e; wrote %s", medians, ratio, max_abs, path
    )
    return 0 if max_abs <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
