"""Interleaved timing with a reset before every step outside the timed region (a Hugging Face cache's write
position goes back, so each timed step is the same step), and correctness against eager on the same case."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from harness.device import Device
from harness.report import diff
from harness.timing import Variant

__all__ = ["check", "time_variants"]


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name)
    return next(
        t for t in (out if isinstance(out, (tuple, list)) else out.values()) if isinstance(t, torch.Tensor)
    )


def check(
    variant: Variant, cases: Sequence[str], reference: dict[str, torch.Tensor], reset: Callable[[], None]
) -> dict[str, dict[str, float]]:
    """max |out - eager| and relative L2 per case (the variant's step from the same state as eager's)."""
    out = {}
    for case in cases:
        reset()
        got = _first_tensor(variant.step(case)).detach().clone()
        out[case] = diff(got.float(), reference[case].float())
    return out


def time_variants(
    variants: Sequence[Variant],
    cases: Sequence[str],
    dev: Device,
    reset: Callable[[], None],
    *,
    iters: int,
    rounds: int,
    on_error: Callable[[str, BaseException], None],
) -> dict[str, dict[str, dict[str, float]]]:
    """``result[variant][case]``: median latency and host ms; variants take turns in ``rounds``."""
    out: dict[str, dict[str, dict[str, float]]] = {v.name: {} for v in variants}
    per_round = max(1, iters // rounds)
    for case in cases:
        alive = []
        for v in variants:
            try:
                for _ in range(2):
                    reset()
                    v.step(case)
                alive.append(v)
            except Exception as exc:
                on_error(f"{v.name} at {case}", exc)
        samples: dict[str, list[tuple[float, float]]] = {v.name: [] for v in alive}
        for _ in range(rounds):
            for v in list(alive):
                try:
                    for _ in range(per_round):
                        reset()
                        samples[v.name].append(dev.time_step(lambda v=v, case=case: v.step(case)))
                except Exception as exc:
                    on_error(f"{v.name} at {case}", exc)
                    alive.remove(v)
        for v in alive:
            ms = [s[0] for s in samples[v.name]]
            out[v.name][case] = {
                "ms": round(statistics.median(ms), 4),
                "host_ms": round(statistics.median(s[1] for s in samples[v.name]), 4),
                "min_ms": round(min(ms), 4),
                "steps": len(ms),
            }
    return out
