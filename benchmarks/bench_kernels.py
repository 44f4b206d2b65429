"""Attention kernels on a GPU: Triton vs the torch reference vs SDPA, against the memory-bandwidth floor.

Qwen3-0.6B attention shapes (16 query heads, 8 kv heads, head dim 128, bf16), a paged cache of 16-token
blocks whose block tables span a 2048-position window (as an engine with max_model_len 2048 keeps them):

* decode at batch 1, 8, 32, 64 with every request at 512 or 2048 tokens of context;
* packed prefill of 1 x 512 and 4 x 128 new tokens (no cached prefix), and a speculative-decoding
  verify step (batch 32, 1 + 3 tokens per request, 512 tokens of context).

Timing: each iteration first reads a 256 MiB buffer (evicting the 50 MB L2 and leaving it clean, as the
weights read by the other 27 layers of a real step would), then queues a ~0.3 ms ``torch.cuda._sleep``
that keeps the GPU busy while the host enqueues the timed launch, so the CUDA events measure GPU time,
not the host's launch latency (what a CUDA graph replay sees). Median over ``--iters`` iterations after
warm-up. ``triton_warm_l2`` is the same without the eviction. ``triton_host_us`` is the median wall time
of one call on the host (checks plus launches, nothing synchronised): what an eager step, or a break op
between graph segments, pays on top. ``one_element_kernel_us`` is the timing's own floor.
SDPA runs on contiguous ``[B, heads, L, D]`` tensors of the real lengths (no paging, no padding).

The floor of a case is the bytes it must move (the KV it reads, q, the output, the block tables) over
the bandwidth of a large device-to-device copy measured in the same run. Correctness is checked in the
same run: the relative L2 error of Triton and SDPA against the float32 torch reference.

``--sweep`` also times other decode and prefill launch configurations (splits, tile sizes, warps,
stages) for tuning ``triton_ops.decode_config``/``prefill_config``. ``--smoke`` runs the script itself on
the CPU (Triton interpreter, tiny shapes, wall-clock timing) and writes nowhere unless ``--out`` is given.

    python benchmarks/bench_kernels.py          # $OUT/kernels.json, else benchmarks/results/h100-kernels.json
    python benchmarks/bench_kernels.py --smoke  # the script's logic on the CPU
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from kernels_timing import Timer, copy_bandwidth, host_time, rel_l2

from devgraph.reference.kernels import PagedMetadata, attention_backend, torch_ref

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
WINDOW = 2048  # positions a block table spans
DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16
SCALE = HEAD_DIM**-0.5
DECODE_CASES = [(b, c) for c in (512, 2048) for b in (1, 8, 32, 64)]
PREFILL_CASES = {"1x512": [512], "4x128": [128] * 4}
VERIFY = (32, 4, 512)  # batch, tokens per request (1 + k), context
DEVICE = "cuda"


def _smoke_settings() -> None:
    """Tiny shapes on the CPU under the Triton interpreter (set before triton is imported)."""
    global HEADS, KV_HEADS, HEAD_DIM, WINDOW, DTYPE, SCALE, DECODE_CASES, PREFILL_CASES, VERIFY, DEVICE
    os.environ["TRITON_INTERPRET"] = "1"
    HEADS, KV_HEADS, HEAD_DIM, WINDOW, DTYPE, DEVICE = 4, 2, 32, 64, torch.float16, "cpu"
    SCALE = HEAD_DIM**-0.5
    DECODE_CASES = [(1, 48), (2, 64)]
    PREFILL_CASES = {"1x32": [32], "2x16": [16, 16]}
    VERIFY = (2, 4, 40)


# -- inputs ------------------------------------------------------------------------------------------
def paged_cache(gen: torch.Generator, requests: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with one 2048-position window per request, and block tables in a random block order."""
    blocks = WINDOW // PAGE
    shape = (requests * blocks, PAGE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    order = torch.randperm(requests * blocks, generator=gen, device=DEVICE)
    return k_cache, v_cache, order.view(requests, blocks).to(torch.int32)


def metadata(
    tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None
) -> PagedMetadata:
    """The attention functions' metadata (the slot mapping, read only by ``write_kv``, is empty)."""
    return PagedMetadata(torch.empty(0, dtype=torch.long, device=DEVICE), tables, seq_lens, cu_seqlens_q)


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Each request's ``[KVH, length, D]`` keys (or values) copied out of the paged cache."""
    return [
        cache[tables[r].long()].flatten(0, 1)[:n].transpose(0, 1).contiguous() for r, n in enumerate(lengths)
    ]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _expand(kv: torch.Tensor) -> torch.Tensor:
    """``[B, KVH, L, D] -> [B, H, L, D]`` contiguous: SDPA without GQA (its flash path on older torch)."""
    return kv.repeat_interleave(HEADS // KV_HEADS, dim=1).contiguous()


def _sdpa_timings(
    timer: Timer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool
) -> dict[str, float]:
    k_full, v_full = _expand(keys), _expand(values)
    return {
        "sdpa": timer(lambda: _sdpa(q, keys, values, causal)),
        "sdpa_expanded_kv": timer(
            lambda: F.scaled_dot_product_attention(q, k_full, v_full, is_causal=causal)
        ),
    }


# -- cases -------------------------------------------------------------------------------------------
def decode_case(
    batch: int, context: int, timer: Timer, gen: torch.Generator, bandwidth: float
) -> dict[str, Any]:
    triton = attention_backend("triton")
    k_cache, v_cache, tables = paged_cache(gen, batch)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
    args = (q, k_cache, v_cache, metadata(tables, seq_lens), SCALE)
    keys = torch.stack(contiguous_kv(k_cache, tables, [context] * batch))  # [B, KVH, L, D]
    values = torch.stack(contiguous_kv(v_cache, tables, [context] * batch))
    q_sdpa = q[:, :, None, :]  # [B, H, 1, D]

    ref = torch_ref.paged_decode_attention(*args)
    out = triton.paged_decode_attention(*args)
    sdpa_out = _sdpa(q_sdpa, keys, values, False)[:, :, 0]
    moved = 2 * batch * context * KV_HEADS * HEAD_DIM * ELEM + 2 * q.numel() * ELEM + tables.numel() * 4
    host = host_time(lambda: triton.paged_decode_attention(*args), DEVICE)
    us = {
        "triton": timer(lambda: triton.paged_decode_attention(*args)),
        "triton_warm_l2": timer(lambda: triton.paged_decode_attention(*args), cold=False),
        "torch_ref": timer(lambda: torch_ref.paged_decode_attention(*args), iters=max(timer.iters // 5, 10)),
        **_sdpa_timings(timer, q_sdpa, keys, values, False),
    }
    return _result("decode", f"b{batch}_ctx{context}", us, host, moved, bandwidth, out, sdpa_out, ref)


def prefill_case(
    name: str,
    query_lens: list[int],
    context: int | None,
    timer: Timer,
    gen: torch.Generator,
    bandwidth: float,
) -> dict[str, Any]:
    """``context`` None: new requests (kv length = query length); else a cached prefix up to ``context``."""
    triton = attention_backend("triton")
    requests, tokens = len(query_lens), sum(query_lens)
    lengths = [context or n for n in query_lens]
    k_cache, v_cache, tables = paged_cache(gen, requests)
    cu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
    args = (q, k_cache, v_cache, metadata(tables, seq_lens, cu), SCALE)
    ref = torch_ref.paged_prefill_attention(*args)
    out = triton.paged_prefill_attention(*args)
    host = host_time(lambda: triton.paged_prefill_attention(*args), DEVICE)
    us = {
        "triton": timer(lambda: triton.paged_prefill_attention(*args)),
        "triton_warm_l2": timer(lambda: triton.paged_prefill_attention(*args), cold=False),
        "torch_ref": timer(lambda: torch_ref.paged_prefill_attention(*args), iters=max(timer.iters // 5, 10)),
    }
    sdpa_out = None
    if context is None and len(set(query_lens)) == 1:  # equal new requests: one dense causal SDPA batch
        keys = torch.stack(contiguous_kv(k_cache, tables, lengths))
        values = torch.stack(contiguous_kv(v_cache, tables, lengths))
        q_sdpa = q.view(requests, query_lens[0], HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        sdpa_out = _sdpa(q_sdpa, keys, values, True).transpose(1, 2).reshape(tokens, HEADS, HEAD_DIM)
        us.update(_sdpa_timings(timer, q_sdpa, keys, values, True))
    kv_read = sum(lengths) * 2 * KV_HEADS * HEAD_DIM * ELEM
    moved = kv_read + 2 * q.numel() * ELEM + tables.numel() * 4
    return _result("prefill", name, us, host, moved, bandwidth, out, sdpa_out, ref)


def _result(
    kind: str,
    name: str,
    us: dict[str, float],
    host_us: float,
    moved: int,
    bandwidth: float,
    out: torch.Tensor,
    sdpa_out: torch.Tensor | None,
    ref: torch.Tensor,
) -> dict[str, Any]:
    floor_us = moved / bandwidth * 1e6
    errors = {"triton": rel_l2(out, ref)}
    if sdpa_out is not None:
        errors["sdpa"] = rel_l2(sdpa_out, ref)
    return {
        "kind": kind,
        "case": name,
        "median_us": {k: round(v, 2) for k, v in us.items()},
        "triton_host_us": round(host_us, 1),
        "bytes": moved,
        "floor_us": round(floor_us, 2),
        "triton_over_floor": round(us["triton"] / floor_us, 2),
        "rel_l2_vs_fp32_reference": {k: float(f"{v:.3g}") for k, v in errors.items()},
    }


# -- sweep -------------------------------------------------------------------------------------------
def _best(timer: Timer, run: Callable[..., Any], configs: list[Any], deadline: float) -> list[Any]:
    """``[(median us, config fields)]`` of the configs timed before ``deadline``, fastest first."""
    timings = []
    for config in configs:
        if time.monotonic() > deadline:
            break
        t = timer(lambda c=config: run(config=c), iters=min(20, timer.iters))
        timings.append((round(t, 2), list(vars(config).values())))
    return sorted(timings)[:6]


def sweep(timer: Timer, gen: torch.Generator, budget_s: float) -> dict[str, Any]:
    """Time other launch configurations within ``budget_s`` seconds; per case the default and the best."""
    from devgraph.reference.kernels import triton_ops

    deadline = time.monotonic() + budget_s
    results: dict[str, Any] = {"decode": {}, "prefill": {}}
    splits_grid = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    decode_configs = [
        triton_ops.DecodeConfig(*c) for c in itertools.product(splits_grid, (16, 32, 64), (2, 4), (2, 3))
    ]
    for batch, context in DECODE_CASES:
        k_cache, v_cache, tables = paged_cache(gen, batch)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
        args = (q, k_cache, v_cache, metadata(tables, seq_lens), SCALE)
        default = triton_ops.decode_config(batch, KV_HEADS, tables.shape[1], PAGE, q.device)
        run = functools.partial(triton_ops.paged_decode_attention, *args)
        results["decode"][f"b{batch}_ctx{context}"] = {
            "default": [round(timer(run, iters=min(20, timer.iters)), 2), list(vars(default).values())],
            "best": _best(timer, run, decode_configs, deadline),
        }
    batch, per_request, context = VERIFY
    prefill_sets = [(name, lens, None, (32, 64, 128)) for name, lens in PREFILL_CASES.items()]
    prefill_sets.append(("verify", [per_request] * batch, context, (16, 32, 64)))
    for name, query_lens, prefix_to, block_ms in prefill_sets:
        requests = len(query_lens)
        k_cache, v_cache, tables = paged_cache(gen, requests)
        cu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=DEVICE)
        lengths = [prefix_to or n for n in query_lens]
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
        meta = metadata(tables, seq_lens, cu)
        run = functools.partial(triton_ops.paged_prefill_attention, q, k_cache, v_cache, meta, SCALE)
        default = triton_ops.prefill_config(len(q), requests, HEAD_DIM)
        configs = [
            triton_ops.PrefillConfig(*c) for c in itertools.product(block_ms, (32, 64, 128), (4, 8), (2, 3))
        ]
        results["prefill"][name] = {
            "default": [round(timer(run, iters=min(20, timer.iters)), 2), list(vars(default).values())],
            "best": _best(timer, run, configs, deadline),
        }
    results["complete"] = time.monotonic() <= deadline
    return results


# -- main --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=100, help="timed iterations per case (median)")
    parser.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    parser.add_argument("--sweep-budget", type=float, default=150.0, help="seconds the sweep may take")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: $OUT/kernels.json)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = parser.parse_args(argv)
    if args.smoke:
        _smoke_settings()
        args.iters = min(args.iters, 3)
        args.sweep_budget = min(args.sweep_budget, 5.0)
    elif not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out_path = args.out
    if out_path is None and not args.smoke:
        out_dir = os.environ.get("OUT")
        out_path = (
            Path(out_dir) / "kernels.json"
            if out_dir
            else Path(__file__).parent / "results" / "h100-kernels.json"
        )

    import triton

    started = time.monotonic()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    timer = Timer(args.iters, DEVICE)
    bandwidth = copy_bandwidth(DEVICE)
    scalar = torch.zeros(1, device=DEVICE)
    empty_us = timer(lambda: scalar.add_(1))  # the smallest kernel: the timing's own floor
    cases = [decode_case(b, c, timer, gen, bandwidth) for b, c in DECODE_CASES]
    cases += [prefill_case(name, lens, None, timer, gen, bandwidth) for name, lens in PREFILL_CASES.items()]
    batch, per_request, context = VERIFY
    cases.append(
        prefill_case(
            f"verify_b{batch}x{per_request}_ctx{context}",
            [per_request] * batch,
            context,
            timer,
            gen,
            bandwidth,
        )
    )
    report: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (--smoke)",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "shape": {
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "dtype": str(DTYPE).removeprefix("torch."),
                "block_size": PAGE,
                "block_table_window": WINDOW,
            },
            "timing": f"median of {args.iters} CUDA-event timings (torch_ref: {max(args.iters // 5, 10)}), "
            "L2 evicted before each",
            "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
            "one_element_kernel_us": round(empty_us, 2),
        },
        "cases": cases,
    }
    by_name = {c["case"]: c for c in cases}
    if not args.smoke:
        one, four = by_name["1x512"]["median_us"]["triton"], by_name["4x128"]["median_us"]["triton"]
        report["targets"] = {
            "decode_b1_ctx512_us": by_name["b1_ctx512"]["median_us"]["triton"],
            "decode_b64_ctx512_over_floor": by_name["b64_ctx512"]["triton_over_floor"],
            "prefill_4x128_over_1x512": round(four / one, 3),
        }
    if args.sweep:
        report["sweep"] = sweep(timer, gen, args.sweep_budget)
        for kind in ("decode", "prefill"):
            for case, found in report["sweep"][kind].items():
                print(f"sweep {case}: default {found['default']}, best {found['best'][:3]}")
    report["meta"]["seconds"] = round(time.monotonic() - started, 1)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1) + "\n")

    meta = report["meta"]
    print(f"\n{meta['device']}, copy bandwidth {meta['copy_bandwidth_GBps']} GB/s; wrote {out_path}")
    columns = ("triton", "warm L2", "host", "torch ref", "sdpa", "floor")
    print(f"{'microseconds':<24}" + "".join(f"{c:>10}" for c in columns) + f"{'x floor':>8}{'rel L2':>10}")
    for c in cases:
        t = c["median_us"]
        row = (t["triton"], t["triton_warm_l2"], c["triton_host_us"], t["torch_ref"], t.get("sdpa", math.nan))
        print(
            f"{c['case']:<24}"
            + "".join(f"{x:>10.1f}" for x in (*row, c["floor_us"]))
            + f"{c['triton_over_floor']:>8.2f}{c['rel_l2_vs_fp32_reference']['triton']:>10.2e}"
        )
    print("targets:", json.dumps(report.get("targets")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
