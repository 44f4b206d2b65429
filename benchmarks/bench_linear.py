"""The decode step's matrix-vector products, timed: devgraph's Triton ``linear`` (every tiling in a sweep)
against cuBLAS (``F.linear``) on the same weights, at the bandwidth of a copy of the same bytes.

At batch 1 a decode step's projections read each weight once: their floor is the weights' bytes over
the memory bandwidth. Each shape below is one projection of a Llama-3-8B layer (whole, and the half a
tensor-parallel rank of two holds) or of a Qwen3-0.6B layer. Every variant runs inside a CUDA graph of
calls that cycle over enough copies of the weight to overflow the L2 cache (a real step reads 32 layers
of distinct weights), so no call finds its weight cached and no launch is timed.

Per shape and rows: microseconds per call, the bandwidth it reached, and its ratio to cuBLAS's time; the
best tiling per shape class; and per model the sum over a layer's four projections. A copy of 1 GiB gives
the bandwidth a copy reaches (read + write bytes over time) and a sum the bandwidth a read reaches; the
spec's is given for reference. Results are checked against a float32 product in the same run.

Then whole reference decoders (``--models``: Qwen3-0.6B's preset, eight layers at Llama-3-8B's widths) at
each decode batch: eager and a hand-written ``torch.cuda.CUDAGraph``, both with cuBLAS projections, and
devgraph ``full`` graphs with cuBLAS and with the Triton projections, against the weights' bandwidth floor,
the Triton graphs' logits compared with the cuBLAS ones.

    python3 benchmarks/bench_linear.py                  # GPU: $OUT/linear.json (else benchmarks/results/)
    python3 benchmarks/bench_linear.py --quick          # fewer tilings
    python3 benchmarks/bench_linear.py --rows 1 --models qwen3-0.6b --batches 1,8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness.device import Device
from harness.plots import Panel, plot_panels
from harness.profile import kernel_times
from harness.report import Report, environment, output_path
from harness.timing import graph_of, steps_in_turns

#: name -> (N, K) of ``y [M, N] = x [M, K] @ w.T``.
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "8b_tp2": {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)},
    "qwen3_06b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}
LM_HEADS = {"8b": (128256, 4096), "8b_tp2": (64128, 4096)}
Run = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SPEC_TBPS = {"H200": 4.8, "H100": 3.35}


def tilings(rows: int, quick: bool) -> list[Any]:
    """The tilings swept at ``rows``: the ``sum`` form over tile widths, depths and warps, a few ``dot``."""
    from devgraph.reference.kernels.triton_linear import LinearConfig

    dot = [(32, 256, 4, 4), (16, 128, 2, 6), (64, 128, 4, 4), (32, 512, 4, 3)]
    if rows == 1:
        summed = [(n, k, w) for n in (1, 2, 4) for k in (512, 1024, 2048) for w in (2, 4, 8)]
    else:
        summed = [(n, k // rows, w) for n in (1, 2, 4) for k in (1024, 2048) for w in (4, 8)]
    if quick:
        dot, summed = dot[:1], [t for t in summed if t[2] == 4]
    return [LinearConfig("dot", n, k, w, s) for n, k, w, s in dot] + [
        LinearConfig("sum", n, max(k, 16), w) for n, k, w in summed
    ]


def graph_time(calls: Callable[[], None], replays: int = 5) -> float:
    """Median milliseconds of one replay of a CUDA graph of ``calls`` (warmed up first)."""
    graph, _ = graph_of(calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


class Case:
    """One projection: ``copies`` weights of ``[N, K]`` (more bytes than the L2 holds four times over),
    one input of ``rows`` rows, and a call that runs a variant once per weight."""

    def __init__(self, n: int, k: int, rows: int, dtype: torch.dtype, l2_bytes: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
        size = n * k * torch.finfo(dtype).bits // 8
        self.copies = max(2, -(-4 * l2_bytes // size))
        self.n, self.k, self.rows, self.bytes = n, k, rows, size
        self.weights = [
            (torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5)
            for _ in range(self.copies)
        ]
        self.x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)

    def per_call_us(self, run: Run) -> float:
        def calls() -> None:
            for w in self.weights:
                run(self.x, w)

        return graph_time(calls) * 1e3 / self.copies

    def error(self, run: Run) -> float:
        """max |run - float32 product| over max |float32 product| (the first weight)."""
        ref = self.x.float() @ self.weights[0].float().T
        got = run(self.x, self.weights[0]).float()
        return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def bandwidth(nbytes: int = 1 << 30) -> dict[str, float]:
    """What the memory reaches outside any product, in TB/s: a copy (read + write bytes) and a sum (read
    bytes), each ``nbytes`` of bfloat16, median of five, timed with events outside a graph."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def median_ms(call: Callable[[], Any]) -> float:
        call()
        times = []
        for _ in range(5):
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return {
        "copy_tbps": round(2 * nbytes / (median_ms(lambda: dst.copy_(src)) * 1e-3) / 1e12, 3),
        "sum_tbps": round(nbytes / (median_ms(lambda: src.sum(dtype=torch.float32)) * 1e-3) / 1e12, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path (default $OUT/linear.json, else benchmarks/results/)")
    parser.add_argument("--quick", action="store_true", help="fewer tilings")
    parser.add_argument("--rows", default="1,2,4,8,16", help="rows to sweep at (default 1,2,4,8,16)")
    parser.add_argument("--models", default="qwen3-0.6b,8b-8l", help="reference decoders to time ('' none)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64", help="their decode batch sizes")
    parser.add_argument("--profile", default="", help="batches to list each variant's kernels at (profiler)")
    parser.add_argument("--plot", metavar="JSON", help="draw the PNG of a saved JSON and stop")
    parser.add_argument("--time-budget", type=float, default=240.0, help="seconds; stops early past it")
    args = parser.parse_args(argv)
    if args.plot:
        source = Path(args.plot)
        plot(json.loads(source.read_text()), source.with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this benchmark times GPU kernels", file=sys.stderr)
        return 2
    from devgraph.reference.kernels.triton_linear import CONFIGS, config_for, linear

    t0 = time.perf_counter()
    dev = Device("cuda")
    dtype = torch.bfloat16
    report = Report(
        output_path("linear.json", "benchmarks/results/linear.json", args.out, False), environment(dev)
    )
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    spec = next((v for k, v in SPEC_TBPS.items() if k in dev.name()), None)
    report.data["bandwidth"] = {**bandwidth(), "spec_tbps": spec, "l2_bytes": l2}
    report.save()
    sweep: dict[str, Any] = {}
    report.data["sweep"] = sweep
    for rows in [int(r) for r in args.rows.split(",") if r]:
        configs = tilings(rows, args.quick)
        for model, shapes in SHAPES.items():
            heads = {"lm_head": LM_HEADS[model]} if model in LM_HEADS and rows == 1 else {}
            for proj, (n, k) in {**shapes, **heads}.items():
                if time.perf_counter() - t0 > args.time_budget:
                    report.data["errors"].append(f"time budget spent before {model}.{proj} at {rows} rows")
                    break
                entry = sweep_one(Case(n, k, rows, dtype, l2), configs, linear, config_for)
                sweep[f"{model}.{proj}@{rows}"] = entry
                print(
                    f"{model}.{proj}@{rows}: cuBLAS {entry['cublas_us']} us, best {entry['best']}", flush=True
                )
                torch.cuda.empty_cache()
            report.save()
    report.data["layer_sums"] = _layer_sums(sweep)
    report.data["models"] = {}
    for name in [m for m in args.models.split(",") if m]:
        if time.perf_counter() - t0 > args.time_budget:
            report.data["errors"].append(f"time budget spent before the model {name}")
            break
        try:
            batches = [int(b) for b in args.batches.split(",")]
            bw = report.data["bandwidth"]
            profiled = [int(b) for b in args.profile.split(",") if b]
            report.data["models"][name] = time_model(name, batches, spec, bw["sum_tbps"], profiled)
        except Exception as exc:  # one model's failure is recorded; the sweep stays
            report.error(f"model {name}", exc)
        torch.cuda.empty_cache()
        report.save()
    report.data["defaults"] = {k: _name(v) for k, v in CONFIGS.items()}
    report.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
    report.save()
    plot(report.data, report.path.with_suffix(".png"))
    print(f"wrote {report.path}")
    return 0


def model_config(name: str) -> Any:
    """``qwen3-0.6b``: the preset (28 layers); ``8b-8l``: eight layers at Llama-3-8B's widths."""
    from devgraph.reference import ReferenceConfig

    if name == "qwen3-0.6b":
        return ReferenceConfig.preset("qwen3-0.6b", max_seq_len=512, max_requests=64)
    if name == "8b-8l":
        return ReferenceConfig(
            vocab_size=128256,
            hidden_size=4096,
            num_layers=8,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            max_requests=64,
            max_seq_len=512,
            dtype=torch.bfloat16,
        )
    raise SystemExit(f"unknown model {name!r}: qwen3-0.6b or 8b-8l")


@contextlib.contextmanager
def cublas_only() -> Iterator[None]:
    """Every projection on cuBLAS while inside (the Triton kernel's tiling table says ``None``)."""
    from devgraph.reference.kernels import triton_linear

    chosen = triton_linear.config_for
    triton_linear.config_for = lambda rows, n, k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        triton_linear.config_for = chosen  # type: ignore[assignment]


def kernel_table(step: Callable[[], Any], steps: int = 10) -> dict[str, Any]:
    """Per kernel name: launches and device microseconds per step (torch.profiler over ``steps`` steps),
    with the totals: what one variant's step runs that another's does not."""
    times = kernel_times(step, steps)
    table: dict[str, Any] = {name: {"per_step": n, "us": round(us, 2)} for name, (n, us) in times.items()}
    table["(total)"] = {
        "per_step": sum(n for n, _ in times.values()),
        "us": round(sum(us for _, us in times.values()), 2),
    }
    return table


def time_model(
    name: str,
    batches: Sequence[int],
    spec: float | None,
    read_tbps: float,
    profile_batches: Sequence[int] = (),
) -> dict[str, Any]:
    """The reference decoder's decode step on one GPU, four ways in one process on the same batches: eager
    and a hand-written ``torch.cuda.CUDAGraph`` of it, both with cuBLAS projections; devgraph ``full``
    graphs with cuBLAS projections; devgraph ``full`` graphs with the Triton ones (what the reference
    decoder runs). Per batch: milliseconds per step (20 back to back, median of seven rounds in which the
    three graphs take turns; eager timed on its own), the weights'
    bandwidth floor (the embedding left out when the LM head is its own weight: a step gathers a few of its
    rows), and the logits of the Triton graphs against the cuBLAS ones; at ``profile_batches`` each
    variant's kernels by name (launches and microseconds per step)."""
    from devgraph.reference import ReferenceModel, decode_runner, make_decode_batch

    config = model_config(name)
    model = ReferenceModel(config, device="cuda", seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        weight_bytes -= model.embed.numel() * model.embed.element_size()
    runners: dict[str, Any] = {}
    for variant in ("cublas", "triton"):
        with cublas_only() if variant == "cublas" else contextlib.nullcontext():
            runners[variant] = decode_runner(model, mode="full", sizes=list(batches), progress=False)
            runners[variant].capture()
    out: dict[str, Any] = {
        "layers": config.num_layers,
        "hidden": config.hidden_size,
        "weight_gb_read_per_step": round(weight_bytes / 1e9, 3),
        "batches": {},
    }
    for b in batches:
        batch = make_decode_batch(model, b, seq_lens=256, seed=b)
        with cublas_only():
            hand, hand_logits = graph_of(functools.partial(model.decode_step, **batch))
        logits = {variant: runner.run(**batch).float().clone() for variant, runner in runners.items()}
        calls: dict[str, Callable[[], Any]] = {
            "hand": hand.replay,
            "cublas": functools.partial(runners["cublas"].run, **batch),
            "triton": functools.partial(runners["triton"].run, **batch),
        }
        row: dict[str, Any] = {}
        # The graphs take turns; the eager steps are timed on their own. With eager steps in the same
        # turn, whichever graph came next replayed up to 10% faster (replay_after_eager.py,
        # h200-replay-after-eager.json): that, not the captures, made the hand-written graph look faster.
        for variant, ms in steps_in_turns(calls).items():
            row[f"{variant}_ms"] = round(ms, 4)
        eager = steps_in_turns({"eager": functools.partial(_eager_cublas, model, batch)}, rounds=3, steps=5)
        row["eager_ms"] = round(eager["eager"], 4)
        floor_ms = weight_bytes / (read_tbps * 1e12) * 1e3
        row["floor_ms_at_read_bw"] = round(floor_ms, 4)
        if spec:
            row["floor_ms_at_spec"] = round(weight_bytes / (spec * 1e12) * 1e3, 4)
            row["triton_over_spec_floor"] = round(row["triton_ms"] / row["floor_ms_at_spec"], 3)
            row["cublas_over_spec_floor"] = round(row["cublas_ms"] / row["floor_ms_at_spec"], 3)
        if b in profile_batches:
            row["kernels"] = {v: kernel_table(calls[v]) for v in ("hand", "cublas", "triton")}
        row["triton_over_cublas"] = round(row["triton_ms"] / row["cublas_ms"], 3)
        row["triton_over_hand"] = round(row["triton_ms"] / row["hand_ms"], 3)
        row["triton_over_read_floor"] = round(row["triton_ms"] / floor_ms, 3)
        ref = logits["cublas"]
        row["cublas_equals_hand"] = bool(torch.equal(ref, hand_logits.float()))
        row["logits_rel_l2"] = round(float((logits["triton"] - ref).norm() / ref.norm()), 5)
        row["greedy_agree"] = round(float((logits["triton"].argmax(-1) == ref.argmax(-1)).float().mean()), 4)
        out["batches"][str(b)] = row
        del hand
        print(f"{name} batch {b}: {row}", flush=True)
    for runner in runners.values():
        runner.close()
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    """The PNG beside the JSON: per model, ms per decode step against the batch (the hand-written graph
    and devgraph's with cuBLAS or Triton projections, the floors dashed); per shape set, a layer's four
    projections in microseconds against the rows (cuBLAS, the tiling :func:`config_for` picks, the best)."""
    panels = []
    for name, model in data.get("models", {}).items():
        batches = list(model["batches"])
        rows = model["batches"]
        panels.append(
            Panel(
                f"{name} decode step ({model['layers']} layers, {model['weight_gb_read_per_step']} GB read)",
                batches,
                {
                    "hand-written graph, cuBLAS": [rows[b]["hand_ms"] for b in batches],
                    "devgraph full, cuBLAS": [rows[b]["cublas_ms"] for b in batches],
                    "devgraph full, Triton projections": [rows[b]["triton_ms"] for b in batches],
                },
                xlabel="decode batch",
                reference={
                    "floor at the spec's bandwidth": [rows[b].get("floor_ms_at_spec") for b in batches],
                    "floor at a sum's bandwidth": [rows[b]["floor_ms_at_read_bw"] for b in batches],
                },
            )
        )
    sums = data.get("layer_sums", {})
    for model in SHAPES:
        keys = [k for k in sums if k.startswith(f"{model}@")]
        if not keys:
            continue
        x = [k.split("@")[1] for k in keys]
        panels.append(
            Panel(
                f"{model}: a layer's four projections",
                x,
                {
                    "cuBLAS": [sums[k]["cublas_us"] for k in keys],
                    "config_for's tiling": [sums[k]["default_us"] for k in keys],
                    "best tiling swept": [sums[k]["best_us"] for k in keys],
                },
                ylabel="us per layer",
                xlabel="rows",
                bars=True,
            )
        )
    if panels:
        plot_panels(path, panels, f"{data['meta']['device']}: matrix-vector products of a decode step")


def _eager_cublas(model: Any, batch: dict[str, torch.Tensor]) -> Any:
    with cublas_only():
        return model.decode_step(**batch)


def sweep_one(case: Case, configs: list[Any], linear: Any, config_for: Any) -> dict[str, Any]:
    """cuBLAS and every tiling on ``case``: microseconds, bandwidth, ratio to cuBLAS, error; the best
    tiling (within 2% relative error of the float32 product) and the one :func:`config_for` picks."""
    cublas = case.per_call_us(F.linear)
    entry: dict[str, Any] = {
        "n": case.n,
        "k": case.k,
        "rows": case.rows,
        "mib": round(case.bytes / 2**20, 1),
        "cublas_us": round(cublas, 2),
        "cublas_tbps": round(case.bytes / cublas / 1e6, 3),
        "tilings": {},
    }
    default = config_for(case.rows, case.n, case.k)
    for c in [*configs, *([default] if default is not None and default not in configs else [])]:
        try:
            us = case.per_call_us(functools.partial(linear, config=c))
            err = case.error(functools.partial(linear, config=c))
        except Exception as exc:  # a tiling that does not build here: recorded, not fatal
            entry["tilings"][_name(c)] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        entry["tilings"][_name(c)] = {
            "us": round(us, 2),
            "tbps": round(case.bytes / us / 1e6, 3),
            "over_cublas": round(us / cublas, 3),
            "rel_err": round(err, 5),
        }
    ok = {t: v for t, v in entry["tilings"].items() if "us" in v and v["rel_err"] < 2e-2}
    best = min(ok, key=lambda t: ok[t]["us"]) if ok else None
    ok["cublas"] = {"us": entry["cublas_us"], "over_cublas": 1.0}
    entry["best"] = best
    entry["default"] = _name(default) if default is not None else "cublas"
    entry["tilings"]["cublas"] = {"us": entry["cublas_us"], "tbps": entry["cublas_tbps"], "over_cublas": 1.0}
    if best:
        entry["best_over_cublas"] = ok[best]["over_cublas"]
    if entry["default"] in ok:
        entry["default_over_cublas"] = ok[entry["default"]]["over_cublas"]
    return entry


def _name(c: Any) -> str:
    return f"{c.form}:{c.block_n}x{c.block_k}w{c.warps}s{c.stages}"


def _layer_sums(sweep: dict[str, Any]) -> dict[str, Any]:
    """Per model and rows: a layer's four projections summed, cuBLAS against the best tiling of each and
    against the default tiling."""
    out: dict[str, Any] = {}
    rows_seen = sorted({e["rows"] for e in sweep.values()})
    for rows in rows_seen:
        for model, shapes in SHAPES.items():
            found = [sweep.get(f"{model}.{p}@{rows}") for p in shapes]
            entries = [e for e in found if e and e["best"]]
            if len(entries) < len(shapes):
                continue
            cublas = sum(e["cublas_us"] for e in entries)
            best = sum(e["tilings"][e["best"]]["us"] for e in entries)
            default = sum(e["tilings"].get(e["default"], {}).get("us", float("nan")) for e in entries)
            out[f"{model}@{rows}"] = {
                "cublas_us": round(cublas, 2),
                "best_us": round(best, 2),
                "default_us": round(default, 2),
                "best_over_cublas": round(best / cublas, 3),
                "default_over_cublas": round(default / cublas, 3),
            }
    return out


if __name__ == "__main__":
    sys.exit(main())
