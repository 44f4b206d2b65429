"""The four measurements of ``bench_beyond.py``, one function each, each returning plain data.

* ``tuning``: a skewed decode trace replayed with the default sizes (recorded), tuned to it
  (``devgraph.tune_phase``, as many sizes), replayed again; padded tokens, tokens/s, graph memory.
* ``guard``: the address guard's host cost per ``run()`` and per check; the three cases it must catch.
* ``fallback``: steps the primary (``full``) declines, replayed by the fallback (``breakable``) graphs,
  against the same steps eager.
* ``pool``: a draft and a target runner capturing into one ``GraphPool`` against two separate pools.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from harness.device import Batch, Device, host_us
from harness.report import diff
from torch import nn

from devgraph import GraphPool, GraphRunner, create_backend, resolve_sizes, tune_phase
from devgraph.errors import ReplayError
from devgraph.reference import (
    ReferenceConfig,
    ReferenceModel,
    StepContext,
    batch_context,
    decode_runner,
    make_decode_batch,
    reference_inputs,
)

log = logging.getLogger("bench_beyond")

#: The skewed trace: batch sizes cluster just above the default capture sizes (an engine whose batch limit
#: and arrival rate put it there), so the defaults pad most steps by most of a bucket.
CLUSTERS = (3, 5, 9, 13, 17, 25, 33, 41, 49, 57, 65, 73, 81, 97, 113, 129, 145)


def skewed_trace(steps: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (1 + i) ** 0.5 for i in range(len(CLUSTERS))]
    return [rng.choices(CLUSTERS, weights)[0] + rng.randint(0, 2) for _ in range(steps)]


def _batches(model: ReferenceModel, sizes: Sequence[int], seq_len: int) -> list[Batch]:
    return [make_decode_batch(model, n, seq_lens=seq_len, seed=i) for i, n in enumerate(sizes)]


def _graph_bytes(dev: Device, build: Callable[[], Any]) -> tuple[Any, int]:
    """What ``build()`` returns, and the reserved bytes it grew the allocator by (cache emptied around)."""
    dev.settle()
    before = dev.reserved()
    made = build()
    dev.settle()
    return made, dev.reserved() - before


def _serve(dev: Device, runner: GraphRunner, batches: list[Batch]) -> float:
    """Seconds for every batch of the trace, one decode step each, through ``runner``."""
    dev.sync()
    start = time.perf_counter()
    for batch in batches:
        runner.run(**batch)
    dev.sync()
    return time.perf_counter() - start


def tuning(model: ReferenceModel, dev: Device, steps: int, seq_len: int) -> dict[str, Any]:
    trace = skewed_trace(steps)
    top = max(trace)
    default_sizes = list(resolve_sizes("decode", None, top).sizes)
    batches = _batches(model, trace, seq_len)

    def build(sizes: list[int]) -> GraphRunner:
        runner = decode_runner(model, mode="full", sizes=sizes, progress=False, record_steps=True)
        runner.capture()
        return runner

    default, default_bytes = _graph_bytes(dev, lambda: build(default_sizes))
    _serve(dev, default, batches[:20])  # warm
    default.reset_stats()
    _serve(dev, default, batches)
    recorded = default.recorded_steps()
    tuned_sizes = list(tune_phase(recorded).axis("tokens").sizes)
    tuned, tuned_bytes = _graph_bytes(dev, lambda: build(tuned_sizes))
    runners = {"default": default, "tuned": tuned}
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(3):  # interleaved rounds; the stats of the last round are reported
        for name, runner in runners.items():
            runner.reset_stats()
            seconds[name].append(_serve(dev, runner, batches))
    tokens = sum(trace)
    out: dict[str, Any] = {"trace_steps": len(trace), "trace_tokens": tokens, "largest_step": top}
    for name, runner in runners.items():
        stats = runner.stats()
        best = min(seconds[name])
        out[name] = {
            "sizes": list(runner.sizes),
            "graphs": len(runner.keys),
            "graph_bytes": default_bytes if name == "default" else tuned_bytes,
            "padded_tokens": stats["padded_rows"],
            "eager_steps": stats["eager"],
            "seconds": seconds[name],
            "tokens_per_s": tokens / best,
        }
    out["padded_cut"] = 1 - out["tuned"]["padded_tokens"] / max(1, out["default"]["padded_tokens"])
    out["tokens_per_s_ratio"] = out["tuned"]["tokens_per_s"] / out["default"]["tokens_per_s"]
    out["graph_bytes_ratio"] = tuned_bytes / max(1, default_bytes)
    check = batches[len(batches) // 2]
    out["outputs_vs_eager"] = diff(tuned.run(**check, copy=True), default.run(**check, copy=True))
    for runner in runners.values():
        runner.close()
    return out


def guard(model: ReferenceModel, dev: Device, iters: int, seq_len: int) -> dict[str, Any]:
    batch = make_decode_batch(model, 1, seq_lens=seq_len, seed=7)
    runners = {
        "guarded": decode_runner(model, mode="full", sizes=[1, 8], progress=False),
        "unguarded": decode_runner(model, mode="full", sizes=[1, 8], progress=False, address_guard=False),
    }
    for runner in runners.values():
        runner.capture()
    run_us: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(5):
        for name, runner in runners.items():
            run_us[name].append(host_us(dev, lambda r=runner: r.run(**batch), iters))
    check = runners["guarded"].life.guard
    assert check is not None
    start = time.perf_counter_ns()
    for _ in range(100_000):
        check.check()
    check_ns = (time.perf_counter_ns() - start) / 100_000
    described = runners["guarded"].inspect()["address_guard"]
    caught = _guard_cases(model, runners["guarded"], batch)
    for runner in runners.values():
        runner.close()
    guarded, unguarded = statistics.median(run_us["guarded"]), statistics.median(run_us["unguarded"])
    return {
        "watched_tensors": described["watched"],
        "per_step_links": described["per_step_links"],
        "run_host_us": {"guarded": guarded, "unguarded": unguarded, "rounds": run_us},
        "run_cost_us": guarded - unguarded,
        "check_us": check_ns / 1e3,
        "caught": caught,
    }


def _guard_cases(model: ReferenceModel, runner: GraphRunner, batch: Batch) -> dict[str, bool]:
    """Replace a weight, re-create a KV cache, free a buffer: each must raise before the replay."""
    layer = model.layers[0]
    cases: dict[str, Callable[[], Callable[[], None]]] = {}

    def weight() -> Callable[[], None]:
        old = layer.o_proj
        layer.o_proj = nn.Parameter(old.detach().clone(), requires_grad=False)
        return lambda: setattr(layer, "o_proj", old)

    def cache() -> Callable[[], None]:
        old = layer.k_cache
        layer.k_cache = torch.zeros_like(old)
        return lambda: setattr(layer, "k_cache", old)

    def freed() -> Callable[[], None]:
        old = layer.v_cache
        layer.v_cache = None
        return lambda: setattr(layer, "v_cache", old)

    cases = {"weight_replaced": weight, "kv_cache_recreated": cache, "buffer_freed": freed}
    caught = {}
    for name, case in cases.items():
        undo = case()
        try:
            runner.run(**batch)
            caught[name] = False
        except ReplayError as exc:
            caught[name] = "changed since" in str(exc)
        undo()
        runner.check_addresses()  # the old tensors are back: the graphs are valid again
    return caught


@dataclasses.dataclass
class Declined(StepContext):
    """A step's context that asks the primary backend to decline it (the host lengths stay for ``sdpa``)."""


def _declining(backend: Any) -> Any:
    """``backend``'s class with a veto: it declines the steps whose context is :class:`Declined`."""
    cls = type(backend)
    veto = {"can_run": lambda self, b: not isinstance(b.context, Declined)}
    return type(f"Declining{cls.__name__}", (cls,), veto)(
        backend.platform, phase=backend.phase, options=backend.options
    )


def fallback(
    models: dict[str, ReferenceModel], dev: Device, cases: Sequence[int], seq_len: int, rounds: int
) -> dict[str, Any]:
    """Per attention: declined steps through the fallback (``breakable``) graphs, against the same steps
    eager (and, for ``paged``, through the primary's ``full`` graphs). Under ``paged`` attention the
    ``breakable`` graph of a key is one segment; under ``sdpa`` the attention break op runs eagerly between
    segments, as it does for a step a ``full`` graph cannot take."""
    out: dict[str, Any] = {"cases": {}}
    for attention, model in models.items():
        primary = _declining(create_backend(model.device, "decode", "full"))
        flag = '{"decode": {"backend": "full", "fallback": "breakable"}}'
        runner = decode_runner(model, backend=primary, config=flag, sizes=list(cases), progress=False)
        runner.capture()
        eager = decode_runner(model, mode="disabled", progress=False)
        for n in cases:
            batch = make_decode_batch(model, n, seq_lens=seq_len, seed=n)
            out["cases"][f"{attention} b{n}"] = _declined_case(
                runner, eager, batch, dev, rounds, attention == "paged"
            )
        out[f"{attention}_stats"] = runner.stats()["fallback"]
        keys = runner.inspect()["fallback"]["keys"]
        out[f"{attention}_fallback_segments"] = {k: v.get("segments") for k, v in keys.items()}
        runner.close()
        eager.close()
    return out


def _declined_case(
    runner: GraphRunner, eager: GraphRunner, batch: Batch, dev: Device, rounds: int, primary_too: bool
) -> dict[str, Any]:
    plain = batch_context(batch)
    declined = Declined(plain.seq_lens, plain.cu_seqlens_q)
    steps = {
        "fallback": lambda: runner.run(**batch, context=declined),
        "eager": lambda: eager.run(**batch, context=plain),
    }
    if primary_too:  # a full graph bakes sdpa's host lengths in: only paged attention's primary is right
        steps["primary"] = lambda: runner.run(**batch, context=plain)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(dev.time_step(step)[0])
    med = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    result = runner.verify(**batch, context=declined)
    return {
        **med,
        "eager_over_fallback": med["eager_ms"] / med["fallback_ms"],
        "verify_ok": result.ok,
        "verify_max_abs_diff": result.max_abs_diff,
    }


def _greedy(model: ReferenceModel, sizes: list[int], pool: GraphPool | None, logits: bool) -> GraphRunner:
    def step(**batch: torch.Tensor) -> torch.Tensor:
        out = model.decode_step(**batch)
        return out if logits else out.argmax(-1)

    inputs = reference_inputs(model)
    return GraphRunner(
        step,
        phase="decode",
        inputs=inputs,
        sizes=sizes,
        device=model.device,
        mode="full",
        pool=pool,
        progress=False,
    )


def pool(target: ReferenceModel, draft: ReferenceModel, dev: Device, sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for outputs in ("tokens", "logits"):
        logits = outputs == "logits"
        # Bytes from each runner's own pool growth per key (graph_memory()), not from the allocator's
        # reserved total: on an H200 that total fell by 6 GB during one capture (earlier sections' cached
        # blocks went back), which made a "separate" figure negative.
        separate = {}
        for name, model in (("draft", draft), ("target", target)):
            dev.settle()
            runner = _capture(_greedy(model, sizes, GraphPool(), logits))
            separate[name] = runner.graph_memory().total_bytes
            runner.close()
            dev.settle()
        shared = GraphPool(name="draft+target")
        pair = [_capture(_greedy(m, sizes, shared, logits)) for m in (draft, target)]
        together = sum(r.graph_memory().total_bytes for r in pair)
        batch = make_decode_batch(target, sizes[len(sizes) // 2], seq_lens=64, seed=3)
        vs_eager = [
            diff(r.run(**batch, copy=True).float(), _greedy_eager(m, batch, logits).float())
            for r, m in zip(pair, (draft, target), strict=True)
        ]
        for runner in pair:
            runner.close()
        dev.settle()
        out[outputs] = {
            "separate_bytes": separate,
            "shared_bytes": together,
            "ratio": together / max(1, sum(separate.values())),
            "outputs_vs_eager": dict(zip(("draft", "target"), vs_eager, strict=True)),
        }
    return out


def _capture(runner: GraphRunner) -> GraphRunner:
    runner.capture()
    return runner


def _greedy_eager(model: ReferenceModel, batch: Batch, logits: bool) -> torch.Tensor:
    with torch.no_grad():
        out = model.decode_step(**batch)
    return out if logits else out.argmax(-1)


def sdpa_twin(model: ReferenceModel) -> ReferenceModel:
    """The same weights (same seed and shape) with the ``sdpa`` attention break op and a cache of its own."""
    twin = ReferenceModel(dataclasses.replace(model.config, attention="sdpa"), device=model.device, seed=0)
    twin.randomize_cache(seed=1)
    return twin


def models(
    smoke: bool, device: torch.device, max_requests: int, seq_len: int
) -> tuple[ReferenceModel, ReferenceModel]:
    """The target (Qwen3-0.6B's shape; tiny on the CPU), a 2-layer draft of the same width and vocabulary."""
    name = "tiny" if smoke else "qwen3-0.6b"
    config = ReferenceConfig.preset(name, max_requests=max_requests, max_seq_len=seq_len)
    target = ReferenceModel(config, device=device, seed=0)
    target.randomize_cache(seed=1)
    draft = ReferenceModel(
        ReferenceConfig.preset(name, max_requests=max_requests, max_seq_len=seq_len, num_layers=2),
        device=device,
        seed=2,
    )
    draft.randomize_cache(seed=3)
    return target, draft


__all__ = ["Declined", "sdpa_twin", "fallback", "guard", "models", "pool", "skewed_trace", "tuning"]
