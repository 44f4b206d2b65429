"""Comparisons over a forward's outputs (a tensor or a tuple/list/dict of them), for verify() and the kit."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["max_abs_diff", "max_abs", "clone_tree"]


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two pytrees of tensors (``inf`` if structure or shapes differ)."""
    leaves_a, leaves_b = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(leaves_a) != len(leaves_b):
        return float("inf")
    worst = 0.0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape:
                return float("inf")
            if x.numel():
                worst = max(worst, (x.detach().double().cpu() - y.detach().double().cpu()).abs().max().item())
    return worst


def max_abs(a: Any) -> float:
    """Largest absolute value over the floating-point (or complex) tensors of a pytree; 0 if none."""
    values = [
        t.detach().abs().max().item()
        for t in pytree.tree_leaves(a)
        if isinstance(t, torch.Tensor) and t.numel() and (t.is_floating_point() or t.is_complex())
    ]
    return max(values, default=0.0)


def clone_tree(a: Any) -> Any:
    """A detached copy of every tensor in a pytree (graph outputs are overwritten by the next replay)."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, a)
