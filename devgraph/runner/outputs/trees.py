"""A forward's outputs as pytrees: dataclasses registered on first sight, flattening, owned copies, copies
into the caller's tensors, and comparisons (for ``verify()`` and the conformance kit).

Outputs are pytrees: tensors, tuples, lists, dicts, namedtuples, dataclasses (registered here on first
sight) and Hugging Face ``ModelOutput`` (registered by transformers), each coming back as its own type.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
from torch.utils import _pytree as pytree

from devgraph.errors import InputError
from devgraph.messages import shorten

__all__ = [
    "copy_into_out",
    "copy_tree",
    "flatten",
    "leaf_paths",
    "max_abs",
    "max_abs_diff",
    "register_dataclasses",
    "same_structure",
    "tensor_leaves",
]

_register_lock = threading.Lock()


def register_dataclasses(tree: Any) -> None:
    """Register every dataclass type inside ``tree`` as a pytree node (fields in order), once."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor) or node is None:
            continue
        kind = type(node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            if kind not in pytree.SUPPORTED_NODES:
                _register(kind)
            if kind in pytree.SUPPORTED_NODES:
                stack.extend(_children(node))
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())


def _children(node: Any) -> list[Any]:
    flatten_fn = pytree.SUPPORTED_NODES[type(node)].flatten_fn
    return list(flatten_fn(node)[0])


_UNSET = object()  # a field declared with init=False that the object never set


def _register(kind: type) -> None:
    """Register ``kind`` with every field as a child: ``init`` fields rebuild the object, the others
    (``field(init=False)``, often set in ``__post_init__``) are set on it afterwards, so their tensors are
    cut, copied and compared like any other output."""
    with _register_lock:
        if kind in pytree.SUPPORTED_NODES:
            return
        init_fields = tuple(f.name for f in dataclasses.fields(kind) if f.init)
        other = tuple(f.name for f in dataclasses.fields(kind) if not f.init)
        names = init_fields + other

        def flatten_fn(obj: Any) -> tuple[list[Any], Any]:
            return [getattr(obj, name, _UNSET) for name in names], None

        def flatten_with_keys_fn(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
            values, context = flatten_fn(obj)
            return [(pytree.GetAttrKey(n), v) for n, v in zip(names, values, strict=True)], context

        def unflatten_fn(values: Any, context: Any) -> Any:
            values = list(values)
            # The fields are restored without calling __init__: a hand-written one may take other arguments,
            # and __post_init__ already ran when the forward built the original.
            obj = kind.__new__(kind)  # type: ignore[call-overload]
            for name, value in zip(init_fields, values[: len(init_fields)], strict=True):
                object.__setattr__(obj, name, value)
            for name, value in zip(other, values[len(init_fields) :], strict=True):
                if value is not _UNSET:
                    object.__setattr__(obj, name, value)  # frozen dataclasses too
            return obj

        pytree.register_pytree_node(
            kind,
            flatten_fn,
            unflatten_fn,
            flatten_with_keys_fn=flatten_with_keys_fn,
            serialized_type_name=f"{kind.__module__}.{kind.__qualname__}",
        )


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``tree``'s leaves and spec, registering dataclasses first."""
    register_dataclasses(tree)
    return pytree.tree_flatten(tree)


def copy_tree(tree: Any) -> Any:
    """Every tensor of ``tree`` cloned (detached): owned by the caller."""
    leaves, spec = flatten(tree)
    return pytree.tree_unflatten(
        [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec
    )


def same_structure(a: pytree.TreeSpec, b: pytree.TreeSpec) -> bool:
    """Whether two specs have the same node types, keys and leaf positions (leaf values not compared).

    Unlike ``a == b`` this never compares tensors a node keeps in its context."""
    if a.is_leaf() or b.is_leaf():
        return a.is_leaf() and b.is_leaf()
    if a.type is not b.type or a.num_children != b.num_children:
        return False
    try:
        if a.context != b.context:  # dict keys, a namedtuple's class, a ModelOutput's field names
            return False
    except Exception:  # a context that cannot be compared as a whole: compare the children only
        pass
    return all(same_structure(x, y) for x, y in zip(a.children(), b.children(), strict=True))


def copy_into_out(result: Any, out: Any) -> Any:
    """Copy the tensors of ``result`` into the matching tensors of ``out`` (same structure); returns ``out``.

    ``out`` leaves may differ in dtype and device (a pinned host buffer): ``copy_`` converts once, and
    returns when the data is there (the caller may read ``out`` at once). A ``None`` leaf in ``out``
    skips that output. Every leaf is checked (structure, shape, and whether it can be written at all)
    before any is written.
    """
    got, got_spec = flatten(result)
    want, want_spec = flatten(out)
    if not same_structure(got_spec, want_spec) and isinstance(result, dict) and isinstance(out, dict):
        # The same keys in another order: match the leaves by key path, not by position.
        by_path = dict(zip(leaf_paths(out, len(want)), want, strict=True))
        paths = leaf_paths(result, len(got))
        if set(paths) == set(by_path):
            want, want_spec = [by_path[p] for p in paths], got_spec
    if not same_structure(got_spec, want_spec):
        raise InputError(
            f"out= must have the structure of the step's outputs ({shorten(got_spec, 200)}), "
            f"got {shorten(want_spec, 200)}; pass the same containers with a tensor (or None) per output"
        )
    pairs = []
    for i, (src, dst) in enumerate(zip(got, want, strict=True)):
        if dst is None or not isinstance(src, torch.Tensor):
            continue
        if not isinstance(dst, torch.Tensor) or dst.shape != src.shape:
            shape = tuple(dst.shape) if isinstance(dst, torch.Tensor) else type(dst).__name__
            raise InputError(
                f"out= leaf {i} is {shape}, the step's output leaf {i} has shape {tuple(src.shape)}"
            )
        reason = _unwritable(dst, src)
        if reason is not None:
            raise InputError(f"out= leaf {i} cannot be written: {reason}; nothing was written")
        pairs.append((src, dst))
    for src, dst in pairs:
        dst.copy_(src)
    return out


def _unwritable(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """Why ``dst.copy_(src)`` would fail, found before anything is written (``None``: it would not)."""
    if dst.requires_grad and dst.is_leaf and torch.is_grad_enabled():
        return "it requires grad (pass a tensor without requires_grad, or call run() under torch.no_grad())"
    if dst.is_inference() and not torch.is_inference_mode_enabled():
        return "it is an inference tensor and run() is not under torch.inference_mode()"
    if torch._debug_has_internal_overlap(dst) == 1:  # 1: elements share memory (expand(), stride 0)
        return "several of its elements share one memory location (an expand()ed or stride-0 tensor)"
    try:  # shapes, dtypes and anything else the kernel checks, on meta tensors: no data is touched
        torch.empty_like(dst, device="meta").copy_(torch.empty_like(src, device="meta"))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def leaf_paths(tree: Any, count: int) -> list[str]:
    """``keystr`` paths of the leaves (``"[0]"``, ``".logits"``, ``"['hidden']"``); indices where a node
    type offers no keys."""
    try:
        return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    except ValueError:  # a node registered without flatten_with_keys_fn
        return [f"[{i}]" for i in range(count)]


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
