"""``devgraph demo --tp N``: the tensor-parallel reference model, eager vs graphs, one process per rank.

Launched by torchrun (``torchrun --nproc-per-node 2 -m devgraph demo --tp 2``), which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address. Each rank drives its GPU over NCCL (or, with
``--device cpu``, the CPU simulator over gloo); every rank runs the same steps in the same order, and rank
0 prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch

from devgraph import ConfigError, DeviceGraphConfig, resolve_platform
from devgraph.cli.demo import (
    DEFAULT_DECODE_SIZES,
    DEFAULT_PREFILL_SIZES,
    _conclude,
    _decode_cases,
    _measure,
    _prefill_cases,
    _print_table,
    _table_title,
)
from devgraph.ranks import destroy_process_group

__all__ = ["run_tp_demo", "tp_launch_env"]


def tp_launch_env(tp: int) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment; a clear error where it is missing
    or disagrees with ``--tp``."""
    missing = [
        name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
    ]
    if missing:
        raise ConfigError(
            f"devgraph demo --tp {tp} runs one process per rank: launch it with "
            f"`torchrun --nproc-per-node {tp} -m devgraph demo --tp {tp}` ({', '.join(missing)} not set)"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise ConfigError(f"--tp {tp} but torchrun started {world} processes; pass --nproc-per-node {tp}")
    rank = int(os.environ["RANK"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def _device(args: argparse.Namespace, local_rank: int) -> torch.device:
    wanted = getattr(args, "device", None)
    if wanted is not None and torch.device(wanted).type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if wanted is not None:
            raise ConfigError(f"--tp with --device {wanted}: no CUDA GPU here; pass --device cpu")
        return torch.device("cpu")
    if torch.cuda.device_count() <= local_rank:
        raise ConfigError(
            f"rank with LOCAL_RANK={local_rank} has no GPU of its own ({torch.cuda.device_count()} visible)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def run_tp_demo(args: argparse.Namespace) -> int:
    """The body of ``devgraph demo --tp N`` (``args``: the demo's namespace plus ``tp``)."""
    tp = int(args.tp)
    rank, world, local_rank = tp_launch_env(tp)
    device = _device(args, local_rank)
    torch.distributed.init_process_group(
        "gloo" if device.type == "cpu" else "nccl", timeout=timedelta(minutes=5)
    )
    try:
        return _run(args, rank, world, device)
    finally:
        destroy_process_group()  # closes any runner still open first, then the process group


def _run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    from devgraph.reference import ReferenceConfig, batch_context, make_decode_batch, make_prefill_batch
    from devgraph.reference.tp import TPReferenceModel, tp_decode_runner, tp_prefill_runner

    config = DeviceGraphConfig.parse(getattr(args, "device_graph_mode", None) or "auto")
    platform = resolve_platform(device)
    on_cpu = device.type == "cpu"
    preset = getattr(args, "preset", None) or ("tiny" if on_cpu else "qwen3-0.6b")
    iters = None if on_cpu else (getattr(args, "iters", None) or 20)  # simulated graphs are not timed
    seed = getattr(args, "seed", 0) or 0
    model_config = ReferenceConfig.preset(preset)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"devgraph demo --tp {world}: reference model '{preset}' ({model_config.dtype}) sharded over "
        f"{world} ranks, {platform.describe()}, backend {torch.distributed.get_backend()}"
    )
    say(f"--device-graph-mode {config.source}")
    # Exact (CPU-drawn) weights equal the single-device model; on a GPU draw there, it is much faster.
    model = TPReferenceModel(
        model_config, torch.distributed.group.WORLD, device=device, seed=seed, exact_weights=on_cpu
    )
    model.randomize_cache(seed=seed)
    decode_sizes = getattr(args, "decode_sizes", None) or DEFAULT_DECODE_SIZES
    prefill_sizes = getattr(args, "prefill_sizes", None) or DEFAULT_PREFILL_SIZES
    seq = model_config.max_seq_len
    decode_batches = [
        (f"{n} req", make_decode_batch(model, n, seq_lens=min(seq, 48 + 7 * n), seed=seed + n))
        for n in _decode_cases(decode_sizes, model_config.max_requests)
    ]
    prefill_batches = [
        ("+".join(map(str, lens)), make_prefill_batch(model, lens, seed=seed))
        for lens in _prefill_cases(prefill_sizes, seq)
        if len(lens) <= model_config.max_requests
    ]
    results: dict[str, Any] = {"preset": preset, "tp": world, "device": str(device), "phases": {}}
    phases = (
        ("decode", tp_decode_runner, decode_sizes, decode_batches),
        ("prefill", tp_prefill_runner, prefill_sizes, prefill_batches),
    )
    for phase, build, sizes, batches in phases:
        with build(model, config=config, sizes=sizes) as runner:
            report = runner.capture()  # every rank, in step; rank 0 shows the bar
            say(f"\n{report.table()}")
            rows = [_measure(runner, label, b, batch_context(b), iters) for label, b in batches]
            if rank == 0:
                _print_table(_table_title(phase, runner.backend.name, iters, f", TP={world}"), rows)
            results["phases"][phase] = {
                "backend": runner.backend.name,
                "rows": [asdict(r) for r in rows],
                "stats": runner.stats(),
            }
    if rank != 0:
        return 0
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return _conclude(results["phases"], on_cpu)
