"""What a sim capture needs to know about one op overload and its arguments: what it reads, writes and
allocates, and which storages its tensors live in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

try:  # torch >= 2.4: ops made by torch.library.custom_op, whose kernel is a Python function
    from torch._library.custom_ops import _maybe_get_opdef
except ImportError:  # pragma: no cover - older torch: every custom op is recorded as one op
    _maybe_get_opdef = None  # type: ignore[assignment]

from devgraph.platforms.sim.device_rules import Rule, rule_for

__all__ = [
    "OpInfo",
    "input_storages",
    "op_info",
    "storage_of",
    "tensors_in",
    "written_tensors",
]

# Ops whose results have undefined contents: replay need not re-run them (the captured buffer is
# simply reused, as a device graph reuses its pool block).
_ALLOCATIONS = frozenset(
    {
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.empty_permuted",
        "aten.new_empty",
        "aten.new_empty_strided",
    }
)

# Ops that hand back, as an alias, a tensor torch made from Python data without dispatching
# (``torch.tensor([...])``, ``torch.as_tensor``): its storage is new even though the schema says alias.
_LITERALS = frozenset({"aten.lift_fresh", "aten.lift"})


@dataclass(frozen=True)
class OpInfo:
    """What capture and replay need to know about one op overload (computed once per overload)."""

    name: str  # overload packet name, e.g. "aten.add"; the ``op`` of a CaptureError
    # The arguments the schema says the op writes, as (position, name): ``self`` of in-place ops,
    # ``out=`` of out variants, the list of ``_foreach_*_`` ops. Non-empty exactly when the schema is
    # mutable: such an op is always re-run.
    writes: tuple[tuple[int, str], ...]
    # Per schema return: not one the op writes in place. Such a return is copied back at replay when
    # it is really new storage; one that shares an input's storage is a view and stays a view.
    readable: tuple[bool, ...]
    single: bool  # one schema return, so the result is not a tuple of returns
    allocation: bool  # an empty-family op: its contents are undefined
    literal: bool  # returns a tensor made from Python data: its storage is new
    builtin: bool  # an aten/prims op: no effect beyond its schema
    python_body: bool  # a torch.library.custom_op: its Python kernel is traced, not recorded whole
    rule: Rule | None
    # A collective (c10d / functional collectives): replay waits for it before its result is read.
    collective: bool = False


_OP_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    """The facts about op overload ``func`` (cached)."""
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = _classify(func)
    return info


def _classify(func: Any) -> OpInfo:
    schema = func._schema
    returns = schema.returns
    name = str(func._overloadpacket)
    builtin = func.namespace in ("aten", "prims")
    writes = tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )
    return OpInfo(
        name=name,
        writes=writes,
        readable=tuple(r.alias_info is None or not r.alias_info.is_write for r in returns),
        single=len(returns) == 1,
        allocation=name in _ALLOCATIONS,
        literal=name in _LITERALS,
        builtin=builtin,
        python_body=not builtin and _maybe_get_opdef is not None and _maybe_get_opdef(func) is not None,
        rule=rule_for(func, name),
        collective=func.namespace in ("c10d", "_c10d_functional") and name.split(".")[-1] != "wait_tensor",
    )


def storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """``(data_ptr, nbytes)`` of the storage under ``tensor`` (``(0, 0)`` when it has none)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts, freed storages
        return 0, 0


def tensors_in(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor among ``values``, looking one level into lists and tuples (aten's ``Tensor[]``)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def input_storages(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """The storages (by data_ptr) of every tensor argument."""
    return {storage_of(t)[0] for t in tensors_in((*args, *kwargs.values()))} - {0}


def written_tensors(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensor arguments the op's schema says it writes."""
    for position, name in info.writes:
        value = args[position] if position < len(args) else kwargs.get(name)
        yield from tensors_in((value,))
