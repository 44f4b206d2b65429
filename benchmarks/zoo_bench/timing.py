"""Correctness against eager on the same case, and timing (``harness.timing.time_cases``) with a reset
before every step outside the timed region (a Hugging Face cache's write position goes back, so each timed
step is the same step)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from harness.device import Device
from harness.report import Report, diff
from harness.timing import Variant, time_cases

from zoo_bench.setup import Built, Plan

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
    name: str, variants: Sequence[Variant], built: Built, plan: Plan, dev: Device, report: Report
) -> dict[str, dict[str, dict[str, float]]]:
    """``result[variant][case]``: median latency and host ms, the variants interleaved in rounds."""
    return time_cases(
        variants,
        list(built.cases),
        dev,
        iters=plan.iters,
        rounds=plan.rounds,
        on_error=lambda what, exc: report.error(f"{name} {what}", exc),
        warm_steps=2,
        before_step=built.reset,
    )
