"""Tensor-parallel decode: eager vs devgraph ``full`` (plain and compiled) vs a hand-written CUDA graph, TP=2.

One process per GPU, launched by torchrun; every rank runs the same steps in the same order::

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --out $OUT/tp.json       # two GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --smoke                  # CPU: gloo, simulated graphs

Model: :class:`~devgraph.reference.tp.TPReferenceModel` (Megatron-style: column-parallel qkv and gate/up,
row-parallel o/down with an all-reduce after each, KV heads split, vocab-parallel head with an all-gather),
bf16, random weights drawn on the GPU, Triton paged attention, collectives issued with plain
``torch.distributed`` calls (NCCL kernels inside the graphs). Presets: ``qwen3-0.6b`` (the issue's target
shape) and ``8b-like`` (hidden 4096, 36 layers, 32 heads, 8 KV heads, intermediate 12288: per-rank work
large enough that splitting it pays, which is what tensor parallelism is for).

Decode batches 1, 8, 32, 64 (every request 1024 tokens long), each captured at exactly its size by both
graph variants: largest first, one pool, one side stream, two warm-ups on it. Variants per batch:
``eager`` (the forward), ``hand`` (copy the inputs into static buffers, ``CUDAGraph.replay()``), ``full``
(``GraphRunner.run``), ``full+lockstep`` (the same runner with the per-step key check on), ``full_compiled``
(``full`` with ``"compiler": "inductor"``: the forward compiled with its NCCL collectives inside, then
captured per size; ``--compiler none`` leaves it out). Latency: median
of per-step ``synchronize`` + ``perf_counter`` wall times on rank 0 (it includes each variant's Python and
the wait for the other rank), variants interleaved in rounds. Correctness in the same run: max |out -
eager| on the same batch for ``hand`` and ``full``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as host_platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tp_hand import HandGraphs

from devgraph import ranks
from devgraph.reference import ReferenceConfig, make_decode_batch
from devgraph.reference.tp import TPReferenceModel, tp_decode_runner

BATCHES = (1, 8, 32, 64)
SMOKE_BATCHES = (1, 2, 4)
NCCL_SAFETY = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def preset(name: str, smoke: bool) -> ReferenceConfig:
    if smoke:
        return ReferenceConfig.preset("tiny", kernels="torch", max_requests=8, max_seq_len=128)
    if name == "8b-like":
        return ReferenceConfig(
            vocab_size=151936,
            hidden_size=4096,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            max_requests=64,
            max_seq_len=2048,
            dtype=torch.bfloat16,
        )
    return ReferenceConfig.preset(name)


class Device:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved()) if self.cuda else 0

    def settle(self) -> None:
        self.sync()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def time_variants(
    variants: Mapping[str, Callable[[], Any]], dev: Device, iters: int, rounds: int
) -> dict[str, float]:
    """Median ms per variant, interleaved in ``rounds``; every rank runs exactly the same calls."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for step in variants.values():  # first calls: lazy inits, allocator growth
        for _ in range(3):
            step()
    dev.sync()
    dist.barrier()
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for name, step in variants.items():
            for _ in range(per_round):
                dev.sync()
                t0 = time.perf_counter()
                step()
                dev.sync()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(x) for name, x in samples.items()}


def bench_preset(
    name: str, args: argparse.Namespace, dev: Device, say: Callable[..., None]
) -> dict[str, Any]:
    config = preset(name, args.smoke)
    batches = SMOKE_BATCHES if args.smoke else BATCHES
    t0 = time.perf_counter()
    model = TPReferenceModel(
        config, dist.group.WORLD, device=dev.device, seed=0, comm=args.comm, exact_weights=False
    )
    model.randomize_cache(seed=0)
    seq = min(1024, config.max_seq_len)
    inputs: dict[int, dict[str, Any]] = {
        n: make_decode_batch(model, n, seq_lens=seq, seed=n) for n in batches
    }
    say(f"{name}: model built in {time.perf_counter() - t0:.1f}s ({model.comm})")
    out: dict[str, Any] = {
        "model": {k: str(v) for k, v in vars(config).items()},
        "comm": model.comm.mode,
        "decode_seq_len": seq,
    }

    dev.settle()
    before = dev.reserved()
    t0 = time.perf_counter()
    hand = HandGraphs(model, batches, dev)
    hand.capture()
    dev.sync()
    out["hand"] = {"capture_seconds": time.perf_counter() - t0, "graph_bytes": dev.reserved() - before}
    dev.settle()
    before = dev.reserved()
    t0 = time.perf_counter()
    runner = tp_decode_runner(model, mode="full", sizes=list(batches), progress=False)
    report = runner.capture()
    dev.sync()
    out["full"] = {"capture_seconds": time.perf_counter() - t0, "graph_bytes": dev.reserved() - before}
    out["full"]["keys"] = [str(k.key) for k in report.keys]
    seconds = (out["hand"]["capture_seconds"], out["full"]["capture_seconds"])
    say(f"{name}: captured hand {seconds[0]:.2f}s, full {seconds[1]:.2f}s")
    compiled = None
    if args.compiler != "none":
        # full with the forward compiled (collectives inside the compiled code), captured per batch size.
        dev.settle()
        before = dev.reserved()
        t0 = time.perf_counter()
        flag = json.dumps({"decode": {"backend": "full", "compiler": args.compiler}})
        compiled = tp_decode_runner(model, config=flag, sizes=list(batches), progress=False)
        compiled_report = compiled.capture()
        dev.sync()
        out["full_compiled"] = {
            "compiler": args.compiler,
            "capture_seconds": time.perf_counter() - t0,
            "graph_bytes": dev.reserved() - before,
            "notes": list(compiled_report.notes),
            "compile": compiled.inspect().get("compile"),
        }
        say(f"{name}: compiled full ({args.compiler}) warm-up {out['full_compiled']['capture_seconds']:.1f}s")

    def lockstep_step(batch: dict[str, Any]) -> Any:
        runner.check_lockstep = True
        try:
            return runner.run(**batch)
        finally:
            runner.check_lockstep = False

    latency: dict[str, dict[str, float]] = {}
    diffs: dict[str, dict[str, float]] = {}
    for n, batch in inputs.items():
        with torch.no_grad():
            eager = model.decode_step(**batch).float()
            diffs[str(n)] = {
                "hand": float((hand.run(batch).float() - eager).abs().max()),
                "full": float((runner.run(**batch).float() - eager).abs().max()),
                "scale": float(eager.abs().max()),
            }
            if compiled is not None:
                # Against eager: the compiled code's fused kernels round differently (bf16), so not 0.
                diffs[str(n)]["full_compiled"] = float((compiled.run(**batch).float() - eager).abs().max())
            variants = {
                "eager": lambda b=batch: model.decode_step(**b),
                "hand": lambda b=batch: hand.run(b),
                "full": lambda b=batch: runner.run(**b),
                "full+lockstep": lambda b=batch: lockstep_step(b),
            }
            if compiled is not None:
                variants["full_compiled"] = lambda b=batch: compiled.run(**b)
            latency[str(n)] = time_variants(variants, dev, args.iters, args.rounds)
        row = latency[str(n)]
        say(
            f"{name} batch {n:>3}: eager {row['eager']:.3f} ms, hand {row['hand']:.3f}, "
            f"full {row['full']:.3f}, full+lockstep {row['full+lockstep']:.3f}, "
            f"compiled {row.get('full_compiled', float('nan')):.3f}; "
            f"max|full-eager| {diffs[str(n)]['full']:.3g}"
        )
    out["latency_ms"] = latency
    out["max_abs_diff_vs_eager"] = diffs
    first = str(batches[0])
    out["targets"] = {
        "full_speedup_vs_eager_batch1": latency[first]["eager"] / latency[first]["full"],
        "full_over_hand": {n: row["full"] / row["hand"] for n, row in latency.items()},
    }
    out["targets"]["met"] = bool(
        out["targets"]["full_speedup_vs_eager_batch1"] >= 3.0
        and all(r <= 1.05 for r in out["targets"]["full_over_hand"].values())
    )
    if compiled is not None:
        # Issue 23's target: compiled full <= 0.9x plain full's latency at batch 1 and 64.
        ratio = {n: row["full_compiled"] / row["full"] for n, row in latency.items()}
        out["targets"]["compiled_over_full"] = ratio
        ends = [ratio[str(batches[0])], ratio[str(batches[-1])]]
        out["targets"]["compiled_met"] = bool(all(r <= 0.9 for r in ends))
        compiled.close()
    runner.close()  # graphs before the process group (and before the hand-written ones' memory goes)
    hand.close()
    dev.settle()
    return out


def meta(args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": host_platform.python_version(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "command": "torchrun --nproc-per-node 2 " + " ".join(["benchmarks/bench_tp.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "timing": "median of per-step synchronize + perf_counter wall times on rank 0, variants interleaved",
        "iters": args.iters,
        "rounds": args.rounds,
        "env": {name: os.environ.get(name) for name in NCCL_SAFETY},
    }
    if dev.cuda:
        info["device"] = torch.cuda.get_device_name()
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        nccl = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["device"] = f"cpu ({host_platform.machine()}), simulated graphs"
    return info


def plot(results: Mapping[str, Any], path: str) -> None:
    """Latency per batch for each variant, one panel per preset (log scale: eager is 10x the graphs)."""
    from pathlib import Path

    from harness.plots import Panel, plot_panels

    panels = []
    for name, preset in results.get("presets", {}).items():
        latency = preset.get("latency_ms", {})
        batches = list(latency)
        variants = list(dict.fromkeys(v for per in latency.values() for v in per))
        series = {v: [latency[b].get(v) for b in batches] for v in variants}
        panels.append(Panel(f"{name}, TP=2 decode", batches, series, xlabel="batch"))
    meta = results.get("meta", {})
    title = (
        f"tensor-parallel decode, {meta.get('world_size')} x {meta.get('device')}, torch {meta.get('torch')}"
    )
    plot_panels(Path(path), panels, title)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON path (written by rank 0)")
    parser.add_argument("--presets", default="qwen3-0.6b,8b-like")
    parser.add_argument("--comm", default="auto", choices=("auto", "torch", "op", "symm"))
    parser.add_argument("--iters", type=int, default=None, help="timed steps per variant and batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=200.0, help="seconds; later presets are skipped")
    parser.add_argument("--smoke", action="store_true", help="CPU: gloo, tiny model, simulated graphs")
    parser.add_argument(
        "--compiler",
        default=None,
        choices=("inductor", "eager", "none"),
        help="compiled full's compiler (default: inductor on a GPU, eager in --smoke; none skips it)",
    )
    parser.add_argument(
        "--plot-from", metavar="JSON", help="only draw the PNG of a recorded run (no torchrun)"
    )
    args = parser.parse_args(argv)
    if args.compiler is None:
        args.compiler = "eager" if args.smoke else "inductor"
    if args.plot_from:
        target = args.plot_from.removesuffix(".json") + ".png"
        with open(args.plot_from) as fh:
            plot(json.load(fh), target)
        print(f"wrote {target}")
        return 0
    args.iters = args.iters or (10 if args.smoke else 100)
    start = time.perf_counter()
    rank = int(os.environ["RANK"])
    if args.smoke:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo" if args.smoke else "nccl", timeout=timedelta(minutes=5))
    dev = Device(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    results: dict[str, Any] = {"meta": meta(args, dev), "presets": {}, "errors": {}}
    say(json.dumps(results["meta"], indent=1))
    for name in args.presets.split(","):
        go = [time.perf_counter() - start < args.time_budget * 0.45 or not results["presets"]]
        dist.broadcast_object_list(go, src=0)  # every rank makes rank 0's decision
        if not go[0]:
            results["errors"][name] = "skipped: past --time-budget"
            continue
        try:
            results["presets"][name] = bench_preset(name, args, dev, say)
        except Exception as exc:  # keep what the other presets measured
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            say(f"{name} failed: {exc}")
            break  # the ranks may be out of step now: stop rather than hang
    results["meta"]["elapsed_s"] = time.perf_counter() - start
    if rank == 0 and args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
        try:
            plot(results, args.out.removesuffix(".json") + ".png")
        except Exception as exc:  # the JSON is what matters; say why the picture is missing
            say(f"plot failed: {type(exc).__name__}: {exc}")
    say(json.dumps({k: v.get("targets") for k, v in results["presets"].items()}, indent=1))
    ranks.destroy_process_group()
    return 0 if not results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
