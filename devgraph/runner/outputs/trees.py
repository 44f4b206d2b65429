"""Comparisons over a forward's outputs (any pytree of tensors), for verify() and the conformance kit."""

from __future__ import annotations

from typing import Any

import torch

from devgraph.runner.outputs.layout import flatten

__all__ = ["max_abs_diff", "max_abs", "tensor_leaves"]


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor leaf of ``tree`` (dataclasses registered as pytree nodes first)."""
    return [t for t in flatten(tree)[0] if isinstance(t, torch.Tensor)]


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two pytrees of tensors (``inf`` if structure or shapes differ)."""
    leaves_a, leaves_b = tensor_leaves(a), tensor_leaves(b)
    if len(leaves_a) != len(leaves_b):
        return float("inf")
    worst = 0.0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            diff = (x.detach().double().cpu() - y.detach().double().cpu()).abs().max().item()
            if diff != diff:  # NaN on one side only is a difference; NaN on both at the same place is not
                same_nan = torch.equal(x.detach().cpu().isnan(), y.detach().cpu().isnan())
                diff = (
                    (x.detach().double().cpu() - y.detach().double().cpu()).nan_to_num(0.0).abs().max().item()
                    if same_nan
                    else float("inf")
                )
            worst = max(worst, diff)
    return worst


def max_abs(a: Any) -> float:
    """Largest finite absolute value over the floating-point (or complex) tensors of a pytree; 0 if none.

    Infinities (a logit masked with -inf) and NaN are left out: a tolerance scaled by them passes anything.
    """
    values = []
    for t in tensor_leaves(a):
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            magnitude = t.detach().abs()
            finite = magnitude[torch.isfinite(magnitude)]
            if finite.numel():
                values.append(finite.max().item())
    return max(values, default=0.0)
