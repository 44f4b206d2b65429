"""Vision encoder on a GPU: eager vs devgraph's lazily capturing ``full`` runner vs a hand-written CUDA graph.

Model: the reference ViT shaped like Qwen2-VL's vision tower (32 blocks of hidden 1280, 16 heads of 80, MLP
5120, patch 1176 values, 2x2 merger to 1536), bf16, random weights, ``varlen`` attention (the Triton
kernel reads the image boundaries from a device tensor). ``--blocks`` cuts the depth.

Cases: S = 256, 1024, 4096 patches split into 1 image, 2 images, 4 equal images and 4 images of different
shapes. Every split of one S replays the same graph (the boundaries live in a static ``cu_seqlens``
buffer), and its output is compared with eager on the same batch in the same run.

Variants:

* ``eager``: ``model(**inputs)``;
* ``devgraph``: ``encoder_runner(model, max_tokens=4096, max_graphs=8)``, lazy: the first step of a token
  bucket captures it (timed as ``first_call_ms``: two warm-up runs, the capture, the replay), later steps
  replay (``steady``);
* ``hand``: a hand-written ``torch.cuda.CUDAGraph`` per S over the same static buffers (inputs copied in,
  ``cu_seqlens`` padded to 9 rows with its last value, one replay), captured the same way, own pool.

Latency is the median over per-step ``synchronize`` + ``perf_counter`` samples (Python cost included),
variants interleaved in rounds. Floors: ``weights_ms`` reads every weight once at the bandwidth of a
1 GiB device-to-device copy measured in the run (read + write bytes counted); ``matmul_ms`` is the step's
GEMM and attention FLOPs at the rate of an 8192^3 bf16 matmul measured in the run.

    python benchmarks/bench_encoder.py                 # $OUT/encoder.json (+ .png), else benchmarks/results/
    python benchmarks/bench_encoder.py --smoke         # the script itself on the CPU (simulated graphs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host_platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from devgraph.reference.encoder import (
    ImageBatch,
    VisionConfig,
    VisionEncoder,
    encode,
    encoder_runner,
    make_image_batch,
)

Split = list[tuple[int, int]]
GPU_CASES: dict[int, dict[str, Split]] = {
    256: {"1": [(16, 16)], "2": [(16, 8)] * 2, "4": [(8, 8)] * 4, "4mix": [(8, 8), (8, 12), (4, 16), (4, 8)]},
    1024: {
        "1": [(32, 32)],
        "2": [(32, 16)] * 2,
        "4": [(16, 16)] * 4,
        "4mix": [(16, 16), (16, 24), (8, 32), (8, 16)],
    },
    4096: {
        "1": [(64, 64)],
        "2": [(64, 32)] * 2,
        "4": [(32, 32)] * 4,
        "4mix": [(32, 32), (32, 48), (16, 64), (16, 32)],
    },
}
SMOKE_CASES: dict[int, dict[str, Split]] = {
    64: {"1": [(8, 8)], "2": [(8, 4)] * 2, "4mix": [(4, 4), (4, 6), (2, 8), (2, 4)]},
    128: {"1": [(8, 16)], "4": [(8, 4)] * 4},
}
MAX_IMAGES = 8
WARMUP_ITERS = 2  # devgraph's default on CUDA; the hand-written capture uses the same


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call, synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read + write bytes counted."""
    src = torch.empty(2**30 if device.type == "cuda" else 2**24, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = [timed(lambda: dst.copy_(src), device) for _ in range(12)][2:]
    return 2 * src.numel() / (statistics.median(times) / 1e3)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul (8192 on a GPU)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = [timed(lambda: a @ b, device) for _ in range(8)][2:]
    return 2 * n**3 / (statistics.median(times) / 1e3)


def step_flops(config: VisionConfig, split: Split) -> int:
    """GEMM and attention FLOPs of one forward over ``split``."""
    h, tokens = config.hidden_size, sum(a * b for a, b in split)
    per_block = 2 * tokens * (4 * h * h + 2 * h * config.intermediate_size)
    attention = sum(4 * (a * b) ** 2 * h for a, b in split)
    merged, wide = tokens // config.merge_unit, h * config.merge_unit
    merger = 2 * merged * wide * (wide + config.out_hidden_size)
    return 2 * tokens * config.patch_dim * h + config.num_layers * (per_block + attention) + merger


class HandGraph:
    """A hand-written CUDA graph for one token count: static buffers, warm-up on a side stream, capture."""

    def __init__(self, model: VisionEncoder, tokens: int) -> None:
        c, device = model.config, model.device
        self.static = {
            "patches": torch.zeros(tokens, c.patch_dim, dtype=c.dtype, device=device),
            "position_ids": torch.zeros(tokens, 2, dtype=torch.int64, device=device),
            "cu_seqlens": torch.zeros(MAX_IMAGES + 1, dtype=torch.int32, device=device),
            "output_order": torch.zeros(tokens // c.merge_unit, dtype=torch.int64, device=device),
        }
        model.ensure_positions(tokens // c.spatial_merge)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(WARMUP_ITERS):
                model(**self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with (
            torch.no_grad(),
            torch.cuda.graph(self.graph, pool=torch.cuda.graph_pool_handle(), stream=stream),
        ):
            self.out = model(**self.static)

    def run(self, batch: ImageBatch) -> torch.Tensor:
        inputs, static = batch.inputs, self.static
        for name in ("patches", "position_ids", "output_order"):
            static[name][: inputs[name].shape[0]].copy_(inputs[name])
        cu = inputs["cu_seqlens"]
        static["cu_seqlens"][: cu.shape[0]].copy_(cu)
        static["cu_seqlens"][cu.shape[0] :].copy_(cu[-1:].expand(MAX_IMAGES + 1 - cu.shape[0]))
        self.graph.replay()
        return self.out[: batch.merged_tokens]


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    diff = (out.float() - ref.float()).abs().max().item()
    return {
        "max_abs_diff": diff,
        "rel": diff / max(ref.float().abs().max().item(), 1e-30),
        "bitwise": bool(torch.equal(out, ref)),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.smoke else "cuda")
    cases = SMOKE_CASES if args.smoke else GPU_CASES
    preset = "tiny" if args.smoke else "qwen2-vl"
    overrides = {} if args.blocks is None else {"num_layers": args.blocks}
    config = VisionConfig.preset(preset, **overrides)
    started = time.perf_counter()
    model = VisionEncoder(config, device=device, seed=0)
    print(
        f"model: {preset}, {config.num_layers} blocks, {model.weight_bytes() / 2**30:.2f} GiB of weights "
        f"({time.perf_counter() - started:.1f}s to build)",
        flush=True,
    )
    bandwidth, rate = copy_bandwidth(device), matmul_rate(device, config.dtype)
    batches = {
        (s, name): make_image_batch(model, split, seed=s + i)
        for s, splits in cases.items()
        for i, (name, split) in enumerate(splits.items())
    }
    eager_fn = {key: partial(model, **b.inputs) for key, b in batches.items()}
    with torch.no_grad():
        for fn in eager_fn.values():  # Triton compiles here, not inside anyone's first capture
            fn()
            fn()
        reference = {key: fn().clone() for key, fn in eager_fn.items()}

    runner = encoder_runner(
        model, max_tokens=max(cases), max_graphs=8, max_images=MAX_IMAGES, warmup_iters=WARMUP_ITERS
    )
    runner.capture()
    results: dict[str, Any] = {}
    first_call: dict[int, float] = {}
    capture_s: dict[int, float] = {}
    hand: dict[int, HandGraph] = {}
    hand_first: dict[int, float] = {}
    for s in cases:
        first_batch = batches[(s, next(iter(cases[s])))]
        before = runner.stats()["lazy"]["capture_seconds"]
        first_call[s] = timed(partial(encode, runner, first_batch), device)
        capture_s[s] = runner.stats()["lazy"]["capture_seconds"] - before
        if device.type == "cuda":
            start = time.perf_counter()
            hand[s] = HandGraph(model, s)
            hand[s].run(first_batch)
            sync(device)
            hand_first[s] = (time.perf_counter() - start) * 1e3
    devgraph_fn = {key: partial(encode, runner, b) for key, b in batches.items()}
    hand_fn = {key: partial(hand[key[0]].run, b) for key, b in batches.items()} if hand else {}
    for key, ref in reference.items():
        entry = results.setdefault(f"S{key[0]}_{key[1]}", {"tokens": key[0], "split": key[1]})
        entry["images"] = batches[key].images
        entry["devgraph_vs_eager"] = compare(encode(runner, batches[key], copy=True), ref)
        if hand_fn:
            entry["hand_vs_eager"] = compare(hand_fn[key]().clone(), ref)

    variants: dict[str, Mapping[tuple[int, str], Callable[[], Any]]] = {
        "eager": eager_fn,
        "devgraph": devgraph_fn,
        **({"hand": hand_fn} if hand_fn else {}),
    }
    samples: dict[tuple[str, Any], list[float]] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for key in batches:
                for name, fns in variants.items():
                    samples.setdefault((name, key), []).extend(
                        timed(fns[key], device) for _ in range(args.iters)
                    )
    for key, batch in batches.items():
        entry = results[f"S{key[0]}_{key[1]}"]
        entry["median_ms"] = {name: statistics.median(samples[(name, key)]) for name in variants}
        entry["floor_ms"] = {
            "weights": model.weight_bytes() / bandwidth * 1e3,
            "matmul": step_flops(config, list(batch.grids)) / rate * 1e3,
        }
        entry["eager_over_devgraph"] = entry["median_ms"]["eager"] / entry["median_ms"]["devgraph"]
    first = {}
    for s in cases:
        eager_ms = results[f"S{s}_{next(iter(cases[s]))}"]["median_ms"]["eager"]
        first[str(s)] = {
            "devgraph_first_call_ms": first_call[s],
            "devgraph_capture_s": capture_s[s],
            "hand_first_call_ms": hand_first.get(s),
            "eager_ms": eager_ms,
            "first_call_in_eager_calls": first_call[s] / eager_ms,
        }
    stats = runner.stats()
    inspect = runner.inspect()
    runner.close()
    small = [e for e in results.values() if e["tokens"] <= 1024]
    return {
        "meta": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else host_platform.processor(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": _version("triton"),
            "python": sys.version.split()[0],
            "command": shlex.join([sys.executable, *sys.argv]),
            "model": {
                "preset": preset,
                "num_layers": config.num_layers,
                "hidden": config.hidden_size,
                "heads": config.num_heads,
                "dtype": str(config.dtype),
                "attention": config.attention,
                "weight_bytes": model.weight_bytes(),
            },
            "copy_bandwidth_bytes_per_s": bandwidth,
            "matmul_flops_per_s": rate,
            "iters": args.iters,
            "rounds": args.rounds,
            "wall_s": time.perf_counter() - started,
        },
        "cases": results,
        "first_sight": first,
        "runner": {
            "lazy": stats["lazy"],
            "replays_by_key": stats["replays_by_key"],
            "pool_bytes": {k: v["pool_bytes"] for k, v in inspect["keys"].items()},
        },
        "targets": {
            "splits_equal_eager": all(e["devgraph_vs_eager"]["rel"] < 2e-2 for e in results.values()),
            "steady_2x_at_S_le_1024": {
                "min_ratio": min(e["eager_over_devgraph"] for e in small),
                "met": all(e["eager_over_devgraph"] >= 2 for e in small),
            },
            "first_sight_le_10_eager": {
                "max_ratio": max(f["first_call_in_eager_calls"] for f in first.values()),
                "met": all(f["first_call_in_eager_calls"] <= 10 for f in first.values()),
            },
        },
    }


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def plot(report: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no plot: {error}"
    names = list(report["cases"])
    variants = list(next(iter(report["cases"].values()))["median_ms"])
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 4.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ax.bar(
            [x + i * width for x in range(len(names))],
            [report["cases"][n]["median_ms"][variant] for n in names],
            width,
            label=variant,
        )
    for kind, marker in (("weights", "_"), ("matmul", "x")):
        ax.scatter(
            [x + 0.4 - width / 2 for x in range(len(names))],
            [report["cases"][n]["floor_ms"][kind] for n in names],
            marker=marker,
            color="k",
            s=120,
            zorder=3,
            label=f"floor: {kind}",
        )
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(
        f"{report['meta']['model']['preset']} ({report['meta']['model']['num_layers']} blocks) "
        f"on {report['meta']['device']}"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def table(report: dict[str, Any]) -> str:
    variants = list(next(iter(report["cases"].values()))["median_ms"])
    lines = [
        f"{'case':<12}{'imgs':>5}"
        + "".join(f"{v:>10}" for v in variants)
        + f"{'eager/dg':>10}{'wfloor':>9}{'mmfloor':>9}{'dg-eager':>10}"
    ]
    for name, e in report["cases"].items():
        lines.append(
            f"{name:<12}{e['images']:>5}"
            + "".join(f"{e['median_ms'][v]:>10.3f}" for v in variants)
            + f"{e['eager_over_devgraph']:>10.2f}{e['floor_ms']['weights']:>9.3f}"
            f"{e['floor_ms']['matmul']:>9.3f}{e['devgraph_vs_eager']['rel']:>10.1e}"
        )
    for s, f in report["first_sight"].items():
        hand = f"{f['hand_first_call_ms']:.1f} ms" if f["hand_first_call_ms"] is not None else "n/a"
        lines.append(
            f"first sight S={s}: devgraph {f['devgraph_first_call_ms']:.1f} ms "
            f"(= {f['first_call_in_eager_calls']:.1f} eager calls), hand {hand}"
        )
    lines.append(f"targets: {json.dumps(report['targets'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (simulated graphs)")
    parser.add_argument("--blocks", type=int, default=None, help="encoder depth (default: the preset's)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per variant, case and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: $OUT/encoder.json)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.rounds = min(args.iters, 3), 1
    report = run(args)
    out = args.out
    if out is None and not args.smoke:
        folder = os.environ.get("OUT")
        out = Path(folder) / "encoder.json" if folder else Path("benchmarks/results/h100-encoder.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        note = plot(report, out.with_suffix(".png"))
        print(note or f"wrote {out} and {out.with_suffix('.png')}")
    print(table(report))


if __name__ == "__main__":
    main()
