"""The memory-bandwidth floor of a step: a large device-to-device copy measured in the same run, and the
bytes a step must move at least (weights read once, the KV actually read, activations)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import torch

from devgraph.reference import ReferenceModel
from harness.device import Batch, Device

__all__ = ["copy_bandwidth", "floor_ms", "step_bytes"]


def copy_bandwidth(dev: Device, nbytes: int, iters: int = 10) -> dict[str, float]:
    """Bandwidth of a large device-to-device copy, counting bytes read and written (median of ``iters``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev.device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = [dev.time_step(lambda: dst.copy_(src))[0] for _ in range(iters)]
    ms = statistics.median(samples)
    src.resize_(0)  # give the memory back before the model is measured
    dst.resize_(0)
    dev.settle()
    return {"bytes_copied": nbytes, "ms": round(ms, 4), "GBps": round(2 * nbytes / (ms * 1e-3) / 1e9, 1)}


def step_bytes(model: ReferenceModel, batch: Batch, out_rows: int) -> dict[str, int]:
    """Bytes one step must move at least: every weight read once (the tied embedding once, as the LM head),
    the KV of every request's context read once, and activations (embedding rows in, new K/V and the
    logits out). Intermediate activations between kernels are left out: the floor is a lower bound."""
    c = model.config
    elem = torch.finfo(c.dtype).bits // 8
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = int(batch["input_ids"].shape[0])
    context = int(batch["seq_lens"].sum().item())
    kv_row = c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem
    activations = tokens * c.hidden_size * elem + tokens * kv_row + out_rows * c.vocab_size * elem
    return {"weights": weights, "kv_read": context * kv_row, "activations": activations}


def floor_ms(nbytes: Mapping[str, int], bandwidth_gbps: float) -> float:
    return sum(nbytes.values()) / (bandwidth_gbps * 1e9) * 1e3
