"""Writes into a view of a forward's state stay in place when inductor compiles the forward.

Why: a decoder that keeps one cache tensor for all layers and writes each layer's slice in place,
``self.k_cache[i, rows, :, positions] = k``, writes into a *view* of a graph input (the buffer, lifted by
dynamo). AOT autograd's functionalization turns that into an out-of-place ``index_put`` of the layer's
slice and a ``select_scatter`` of the result into a new copy of the **whole** cache, one per layer, chained,
with one ``copy_`` back into the buffer at the end. Inductor's re-inplacing pass gives up on that chain (its
heuristic keeps a scatter functional unless its output is copied straight back into the input, which only
the last one is), so every step copies the whole cache once per layer or more: time that grows with layers
x cache size and not with the batch. On an H100 that made a 28-layer, Qwen3-0.6B-shaped decoder replay in
219 ms instead of 2.9 ms (docs/performance.md has the evidence and the figures).

What devgraph does: before inductor sees dynamo's graph, each such write (``operator.setitem`` on a graph
input with a key that takes a view first, or an in-place method such as ``index_copy_`` / ``copy_`` called
on a view of a graph input) becomes a call of :func:`write_into`, a custom op that declares the mutation of
its target. Functionalization wraps a custom op's mutation in ``auto_functionalized``, which inductor does
re-inplace on graph inputs: the write runs in place on the buffer (torch's own indexing kernel) and nothing
is copied. Writes inductor already keeps in place (into the whole input with tensor indices only, or into an
intermediate tensor) are left as they are, so their fusion with the code around them is kept.
"""

from __future__ import annotations

import json
import logging
import operator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["IN_PLACE_METHODS", "keep_writes_in_place", "write_into"]

logger = logging.getLogger(__name__)

#: In-place tensor methods rewritten when called on a view of a graph input (their out-of-place forms
#: lose the same way through functionalization).
IN_PLACE_METHODS = frozenset(
    {
        "copy_",
        "index_copy_",
        "index_put_",
        "index_fill_",
        "index_add_",
        "scatter_",
        "masked_fill_",
        "fill_",
        "zero_",
    }
)
_SETITEM = "__setitem__"


@torch.library.custom_op("devgraph::write_into", mutates_args=("target",))
def write_into(
    target: torch.Tensor, method: str, spec: str, tensors: list[torch.Tensor], ints: list[int]
) -> None:
    """``target.<method>(*args)`` with the arguments rebuilt from ``spec`` (their structure, as JSON) and
    the tensors and integers it refers to; ``__setitem__`` is ``target[key] = value``."""
    args = [_decode(item, tensors, ints) for item in json.loads(spec)]
    if method == _SETITEM:
        target[args[0]] = args[1]
    else:
        getattr(target, method)(*args)


@write_into.register_fake
def _write_into_fake(
    target: torch.Tensor, method: str, spec: str, tensors: list[torch.Tensor], ints: list[int]
) -> None:
    return None


def _decode(item: Any, tensors: list[torch.Tensor], ints: list[int]) -> Any:
    if not isinstance(item, dict):
        return item  # an int, float, bool or None
    if "t" in item:
        return tensors[item["t"]]
    if "j" in item:
        return ints[item["j"]]
    if "s" in item:
        return slice(*(_decode(part, tensors, ints) for part in item["s"]))
    if "e" in item:
        return Ellipsis
    return tuple(_decode(part, tensors, ints) for part in item["l"])


class _Unsupported(Exception):
    """An argument :func:`write_into` cannot carry: the write is left as dynamo traced it."""


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[torch.fx.Node] = []
        self.ints: list[Any] = []

    def encode(self, value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            example = value.meta.get("example_value")
            if isinstance(example, torch.Tensor):
                self.tensors.append(value)
                return {"t": len(self.tensors) - 1}
            if isinstance(example, (int, torch.SymInt)) and not isinstance(example, bool):
                self.ints.append(value)
                return {"j": len(self.ints) - 1}
            raise _Unsupported(f"argument {value} of kind {type(example).__name__}")
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if value is Ellipsis:
            return {"e": 1}
        if isinstance(value, slice):
            return {"s": [self.encode(value.start), self.encode(value.stop), self.encode(value.step)]}
        if isinstance(value, (tuple, list)):
            return {"l": [self.encode(v) for v in value]}
        raise _Unsupported(f"argument of type {type(value).__name__}")


def _storage(node: Any) -> StorageWeakRef | None:
    example = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if not isinstance(example, torch.Tensor):
        return None
    try:
        return StorageWeakRef(example.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor without storage (a subclass) is not a buffer we rewrite
        return None


def _takes_view_first(key: Any) -> bool:
    """Whether indexing with ``key`` starts with a view (an int or a slice that is not ``:``), which makes
    functionalization scatter the result back into the whole tensor."""
    parts = key if isinstance(key, tuple) else (key,)
    for part in parts:
        if isinstance(part, slice) and (part.start, part.stop, part.step) != (None, None, None):
            return True
        if isinstance(part, int) and not isinstance(part, bool):
            return True
        if isinstance(part, torch.fx.Node) and not isinstance(part.meta.get("example_value"), torch.Tensor):
            return True  # a symbolic int
    return False


def _write(node: torch.fx.Node) -> tuple[Any, str, list[Any]] | None:
    """(target, method, arguments) of an in-place write, or ``None``."""
    if (
        node.op == "call_function"
        and node.target is operator.setitem
        and len(node.args) == 3
        and not node.kwargs
    ):
        target, key, value = node.args
        return target, _SETITEM, [key, value]
    if node.op == "call_method" and node.target in IN_PLACE_METHODS and not node.kwargs and node.args:
        return node.args[0], str(node.target), list(node.args[1:])
    return None


def keep_writes_in_place(gm: torch.fx.GraphModule) -> int:
    """Rewrite the writes into views of ``gm``'s inputs as :func:`write_into` calls (see the module's
    docstring); returns how many were rewritten."""
    inputs = {node: _storage(node) for node in gm.graph.nodes if node.op in ("placeholder", "get_attr")}
    storages = {s for s in inputs.values() if s is not None}
    if not storages:
        return 0
    rewritten = 0
    for node in list(gm.graph.nodes):
        write = _write(node)
        if write is None:
            continue
        target, method, args = write
        storage = _storage(target)
        if storage is None or storage not in storages:
            continue  # an intermediate tensor: inductor keeps that write in place itself
        if target in inputs and (method != _SETITEM or not _takes_view_first(args[0])):
            continue  # the whole input, indexed by tensors only: re-inplaced without help
        if method == _SETITEM and not isinstance(args[1], torch.fx.Node):
            continue  # a Python scalar written: rare in caches, left to inductor
        encoder = _Encoder()
        try:
            spec = json.dumps([encoder.encode(arg) for arg in args])
        except _Unsupported as exc:
            logger.debug("devgraph: write %s left as traced: %s", node, exc)
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(
                torch.ops.devgraph.write_into.default, (target, method, spec, encoder.tensors, encoder.ints)
            )
        call.meta.update(node.meta)
        if method != _SETITEM:
            node.replace_all_uses_with(target)  # an in-place method returns its target
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
