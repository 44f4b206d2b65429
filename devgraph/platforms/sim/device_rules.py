"""The device rules a sim capture enforces, and the advice its errors give.

A device graph cannot hold an op that syncs with the host (``.item()``, ``.tolist()``, ``bool(t)``,
``torch.equal``) or whose output shape depends on tensor data (``nonzero``, ``masked_select``,
``unique``, boolean-mask indexing): the capture records kernels without running them, so nothing is
there to read. Each rule here names what an op does wrong and what to write instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from devgraph.errors import CaptureError

__all__ = [
    "HOST_READ_CALLS",
    "Rule",
    "Violation",
    "host_read_error",
    "rule_for",
    "violation_error",
]


class Violation(NamedTuple):
    what: str  # what the op does wrong, e.g. "syncs with the host"
    advice: str


Rule = Callable[[tuple[Any, ...], dict[str, Any]], Violation | None]

_HOST_SYNC = "syncs with the host"
_DYNAMIC_SHAPE = "has a data-dependent output shape (a device syncs with the host to size it)"
_SCALAR_ADVICE = "move it out of the captured forward or read the value from the forward context"
_MOVE_OUT = "move it out of the captured forward"
_MASK_ASSIGN = "use x.masked_fill_(mask, v) instead of boolean-mask assignment (`x[mask] = v`)"
_MASK_DTYPES = (torch.bool, torch.uint8)


def _always(what: str, advice: str) -> Rule:
    violation = Violation(what, advice)
    return lambda args, kwargs: violation


def _when_bool_index(what: str, advice: str) -> Rule:
    """Indexing with a boolean mask hides a ``nonzero``; integer indices keep the shape static."""
    violation = Violation(what, advice)

    def rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Violation | None:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masked = any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices)
        return violation if masked else None

    return rule


def _when_output_size_missing(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Violation | None:
    if kwargs.get("output_size") is None:
        return Violation(
            _DYNAMIC_SHAPE, "pass output_size=... so the output shape is known without reading `repeats`"
        )
    return None


def _when_num_classes_missing(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Violation | None:
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if num_classes < 0:
        return Violation(_DYNAMIC_SHAPE, "pass num_classes=... so the output shape is known")
    return None


_UNIQUE = _always(_DYNAMIC_SHAPE, "compute it outside the captured forward and pass it in as a static input")
_COMPARE = _always(
    _HOST_SYNC,
    "it returns a Python bool: keep the comparison on the device (e.g. `torch.eq(a, b).all()`) "
    "or move it out of the captured forward",
)

# Keyed by overload name, else by overload packet name; a rule here overrides the op's tags
# (``aten.index`` is tagged dynamic_output_shape, but only boolean-mask indexing really is).
_RULES: dict[str, Rule] = {
    "aten._local_scalar_dense": _always(_HOST_SYNC, _SCALAR_ADVICE),
    "aten.item": _always(_HOST_SYNC, _SCALAR_ADVICE),
    "aten.equal": _COMPARE,
    "aten.allclose": _COMPARE,
    "aten.is_nonzero": _always(_HOST_SYNC, _SCALAR_ADVICE),
    "aten.nonzero": _always(
        _DYNAMIC_SHAPE, "use torch.nonzero_static(x, size=...) or keep a fixed-size mask and torch.where"
    ),
    "aten.argwhere": _always(_DYNAMIC_SHAPE, "use torch.nonzero_static(x, size=...) or a fixed-size mask"),
    "aten.masked_select": _always(_DYNAMIC_SHAPE, "use torch.where(mask, x, fill) to keep a static shape"),
    "aten._unique": _UNIQUE,
    "aten._unique2": _UNIQUE,
    "aten.unique_dim": _UNIQUE,
    "aten.unique_consecutive": _UNIQUE,
    "aten.unique_dim_consecutive": _UNIQUE,
    "aten.bincount": _always(
        _DYNAMIC_SHAPE, "scatter_add_ into a fixed-size buffer, or compute it outside the captured forward"
    ),
    "aten.repeat_interleave.Tensor": _when_output_size_missing,  # not .self_int: an int count is static
    "aten.repeat_interleave.self_Tensor": _when_output_size_missing,
    "aten.one_hot": _when_num_classes_missing,
    "aten.index": _when_bool_index(
        _DYNAMIC_SHAPE, "use torch.where(mask, x, fill) instead of boolean-mask indexing (`x[mask]`)"
    ),
    # Nested tensors and packed sequences are built from values read on the host (a padding mask, the
    # lengths): nn.TransformerEncoder's fast path with a src_key_padding_mask, pack_padded_sequence.
    "aten._nested_tensor_from_mask_left_aligned": _always(
        _HOST_SYNC, "pass the padding mask to a capturable attention (a float mask), or disable the fast path"
    ),
    "aten._nested_tensor_from_mask": _always(
        _DYNAMIC_SHAPE, "use a dense padding mask instead of nested tensors in the captured forward"
    ),
    "aten._pack_padded_sequence": _always(
        _DYNAMIC_SHAPE, "keep padded sequences and a mask in the captured forward, or pack outside it"
    ),
    "aten.index_put": _when_bool_index(_HOST_SYNC, _MASK_ASSIGN),
    "aten.index_put_": _when_bool_index(_HOST_SYNC, _MASK_ASSIGN),
    "aten._index_put_impl_": _when_bool_index(_HOST_SYNC, _MASK_ASSIGN),
}

_SCALAR_READS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.is_nonzero"})

# How the Python-level call that led to a scalar read is shown in the error, by function name.
_SCALAR_CALLS = {
    "item": "`.item()`",
    "tolist": "`.tolist()`",
    "__bool__": "`bool(t)` (or `if t:`)",
    "__int__": "`int(t)`",
    "__float__": "`float(t)`",
    "__complex__": "`complex(t)`",
    "__index__": "using a tensor as a Python int",
    "__format__": "formatting a tensor",
    "__repr__": "printing a tensor",
    "__str__": "printing a tensor",
}

_DATA_DEPENDENT_TAG = getattr(torch.Tag, "data_dependent_output", None)
_DYNAMIC_SHAPE_TAG = getattr(torch.Tag, "dynamic_output_shape", None)


def rule_for(func: Any, name: str) -> Rule | None:
    """The capture rule for the op overload ``func`` (packet name ``name``): from the table, else from
    the op's tags; ``None`` when the op can always be captured."""
    rule = _RULES.get(str(func)) or _RULES.get(name)
    if rule is not None:
        return rule
    tags = getattr(func, "tags", ())
    if _DATA_DEPENDENT_TAG is not None and _DATA_DEPENDENT_TAG in tags:
        return _always(_HOST_SYNC, _MOVE_OUT)
    if _DYNAMIC_SHAPE_TAG is not None and _DYNAMIC_SHAPE_TAG in tags:
        return _always(_DYNAMIC_SHAPE, _MOVE_OUT)
    return None


def _api_name(func: Any) -> str:
    """How a user would write the Python-level call ``func``: ``Tensor.nonzero``, ``torch.unique``."""
    name = getattr(func, "__name__", None) or str(func)
    qualname = getattr(func, "__qualname__", "") or ""
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if qualname.startswith("_VariableFunctionsClass.") or getattr(func, "__module__", "") in (
        "torch",
        "torch.functional",
    ):
        return f"torch.{name}"
    return qualname or name


def violation_error(op_name: str, violation: Violation, api: Any) -> CaptureError:
    """The error for op ``op_name`` breaking a rule, shown through the Python-level call ``api`` that
    issued it (``None`` when unknown)."""
    if op_name in _SCALAR_READS:
        shown = _SCALAR_CALLS.get(getattr(api, "__name__", ""), "")
        subject = (
            f"{shown} ({op_name})"
            if shown
            else f"{op_name} (`.item()`, `.tolist()`, `int(t)`, `float(t)` or `bool(t)`)"
        )
    elif api is None or isinstance(api, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        subject = op_name  # called as torch.ops.*: the op name says it all
    else:
        subject = f"`{_api_name(api)}` ({op_name})"
    message = f"{subject} {violation.what} and cannot be captured; {violation.advice}"
    return CaptureError(message, op=op_name)


def _host_read_calls() -> dict[Any, tuple[str, str, str]]:
    """Python-level calls that read tensor memory on the host without dispatching an aten op,
    as (how the user wrote it, the op to report, what it does)."""
    numpy_read = "reads tensor memory on the host"
    return {
        torch.Tensor.tolist: ("`.tolist()`", "aten._local_scalar_dense", _HOST_SYNC),
        torch.Tensor.numpy: ("`.numpy()`", "Tensor.numpy", numpy_read),
        torch.Tensor.__array__: ("`numpy.asarray(t)`", "Tensor.numpy", numpy_read),
    }


HOST_READ_CALLS = _host_read_calls()


def host_read_error(shown: str, op: str, what: str) -> CaptureError:
    """The error for a Python-level host read (one of :data:`HOST_READ_CALLS`) during capture."""
    return CaptureError(
        f"{shown} ({op}) {what} and cannot be captured; {_SCALAR_ADVICE} "
        "(code that must run on the host at every replay can go in platform.record_opaque)",
        op=op,
    )
