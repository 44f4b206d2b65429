"""Replay steps: the closures a sim graph runs, in order, each time it replays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["Segment", "Step", "Target", "op_step", "opaque_step"]

Step = Callable[[], object]  # what a step returns is ignored
# One segment of a finalized graph: (run with the kernel dispatch keys?, steps, step names).
Segment = tuple[bool, tuple[Step, ...], tuple[str, ...]]
# A tensor an op allocated at capture, as (return index, list index or None, the captured tensor).
Target = tuple[int, int | None, torch.Tensor]


def _finish_collective(result: Any) -> None:
    """Wait for a collective re-run at replay before anything reads its result (it may complete async)."""
    for value in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(value, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(value)
        elif isinstance(value, (list, tuple)):
            _finish_collective(value)
        elif hasattr(value, "wait"):  # a c10d Work handle
            value.wait()


def op_step(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    targets: list[Target],
    single: bool,
    collective: bool = False,
) -> Step:
    """A closure that re-runs ``func`` on the captured arguments and copies fresh results back.

    A collective (``c10d``/``_c10d_functional`` ops) is waited for first, so its result is complete when
    it is copied and when later steps read it.
    """
    call = getattr(func, "_op", func)  # the C++ entry point: skips OpOverload.__call__'s Python frame
    if collective:
        plain = call

        def call(*a: Any, **k: Any) -> Any:
            result = plain(*a, **k)
            _finish_collective(result)
            return result

    if not targets:
        if kwargs:
            return lambda: call(*args, **kwargs)
        return lambda: call(*args)
    if single and len(targets) == 1 and targets[0][1] is None:
        copy = targets[0][2].copy_
        if kwargs:
            return lambda: copy(call(*args, **kwargs))
        return lambda: copy(call(*args))
    plan = tuple((i, j, tensor.copy_) for i, j, tensor in targets)

    def step() -> None:
        result = call(*args, **kwargs)
        values = (result,) if single else result
        for i, j, copy_into in plan:
            copy_into(values[i] if j is None else values[i][j])

    return step


def opaque_step(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Step:
    """A closure that calls ``fn`` again and copies its tensor results into the captured ones.

    The call runs with the grad mode it was captured under, as a device replays the kernels it captured
    whatever the caller's grad mode is (a compiled function would otherwise fail dynamo's grad-mode guard
    and recompile at replay).
    """
    grad = torch.is_grad_enabled()
    raw = fn

    def call(*a: Any, **k: Any) -> Any:
        with torch.set_grad_enabled(grad):
            return raw(*a, **k)

    fn = call
    if isinstance(result, torch.Tensor):
        captured = result

        def step_tensor() -> None:
            new = fn(*args, **kwargs)
            if new is not captured:
                captured.copy_(new)

        return step_tensor
    plan = tuple((i, leaf) for i, leaf in enumerate(tree_leaves(result)) if isinstance(leaf, torch.Tensor))
    if not plan:
        return lambda: fn(*args, **kwargs)

    def step() -> None:
        leaves = tree_leaves(fn(*args, **kwargs))
        for i, captured_leaf in plan:
            new = leaves[i]
            if new is not captured_leaf:
                captured_leaf.copy_(new)

    return step
