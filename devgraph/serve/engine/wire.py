"""A step as bytes: a fixed binary layout of integer (and float) arrays, no pickle.

The engine encodes each step once (:func:`encode_step`) into one buffer, pinned on a GPU, which crosses to
the device in one non-blocking copy (:meth:`StepMessage.inputs`: each input a view of it), so staging a
step never makes the host wait for the device. Under tensor parallelism the same buffer goes into the step
ring as it is; every rank, rank 0 included, turns the same bytes into its inputs, so all ranks replay
identical inputs by construction. Layout::

    header       "<4sHH16sQ"       magic b"DGTS", format version, array count, the step's kind (ASCII),
                                   step number
    descriptors  "<24sBBBx4IIQ"    per array: name, dtype code, dims, role (an input tensor or a field of
                                   the step context), shape (4 dims), columns in full, payload offset
    payload      each array's bytes, 64-byte aligned (so every array views the buffer in place)

A 2-D input may be sent narrower than it is (``columns=``): the block tables are as wide as the longest
context allowed, while a step reads only the blocks its longest request holds; the columns left out are
zeros on every rank. On a GPU the payload crosses to the device in one copy from pinned memory
(non-blocking), and each input is a view of that one device buffer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct
from array import array as _PyArray
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from devgraph.reference.inputs import StepContext

__all__ = [
    "STOP",
    "TRIM_MIN_BYTES",
    "StepMessage",
    "decode_step",
    "encode_step",
    "input_views",
    "stop_message",
]

STOP = "stop"
#: Columns of a 2-D input are left off the wire only when that saves this many bytes or more.
TRIM_MIN_BYTES = 64 << 10
_MAGIC = b"DGTS"
_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQ")
_STEP, _STEP_AT = struct.Struct("<Q"), 24  # the header's step number
_ARRAY = struct.Struct("<24sBBBx4IIQ")
_ALIGN = 64
_INPUT, _CONTEXT = 0, 1
_DTYPES = (
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
#: ``array.array`` inputs by type code (the engine's block-table changes): 8- and 4-byte signed ints.
_ARRAY_DTYPES = {"q": torch.int64, "i": torch.int32}
_CONTEXT_FIELDS = tuple(field.name for field in dataclasses.fields(StepContext))


class _Array(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # as sent
    full: int  # the last dim's full size (wider than sent when columns were left out)
    role: int
    offset: int  # into the buffer
    nbytes: int
    strides: tuple[int, ...]  # contiguous, of the shape as sent


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _array(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], full: int, role: int, offset: int
) -> _Array:
    strides, elements = [], 1
    for dim in reversed(shape):
        strides.append(elements)
        elements *= dim
    return _Array(name, dtype, shape, full, role, offset, elements * dtype.itemsize, tuple(reversed(strides)))


def _bytes_view(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor's memory (no numpy needed)."""
    return memoryview((ctypes.c_char * int(buffer.numel())).from_address(int(buffer.data_ptr()))).cast("B")


@dataclass
class StepMessage:
    """One step as bytes (``buffer``, a CPU uint8 tensor: pinned when the step goes to a GPU) and its
    layout; :data:`STOP` as ``kind`` ends a worker."""

    kind: str
    step: int
    buffer: torch.Tensor
    arrays: tuple[_Array, ...]

    def inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The step's input tensors on ``device``: views of the buffer on the CPU; on a GPU views of one
        device copy of the message (non-blocking: the buffer is pinned; the header's few hundred bytes
        cross too, which costs less than cutting them off)."""
        region = self.buffer
        if device.type != "cpu":
            region = region.to(device, non_blocking=region.is_pinned())
        views, narrow = input_views(self.arrays, region)
        for name, full in narrow:
            views[name] = torch.nn.functional.pad(views[name], (0, full - views[name].shape[-1]))
        return views

    def context(self) -> StepContext:
        """The host-side lengths the step carries (``seq_lens``, ``cu_seqlens_q``)."""
        view = _bytes_view(self.buffer)
        values: dict[str, Any] = {}
        for array in self.arrays:
            if array.role == _CONTEXT:
                values[array.name] = list(struct.unpack_from(f"<{array.shape[0]}q", view, array.offset))
        return StepContext(**values)


def input_views(
    arrays: tuple[_Array, ...], region: torch.Tensor
) -> tuple[dict[str, torch.Tensor], tuple[tuple[str, int], ...]]:
    """Each input array of a message as a view of ``region`` (the message's bytes, wherever they are), and
    the inputs sent narrower than they are with their full width (the caller pads those; the pad is a new
    tensor, made per step)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views: dict[str, torch.Tensor] = {}
    narrow: list[tuple[str, int]] = []
    for array in arrays:
        if array.role != _INPUT:
            continue
        whole = typed.get(array.dtype)
        if whole is None:
            whole = typed[array.dtype] = region.view(array.dtype)
        first = whole.storage_offset() + array.offset // array.dtype.itemsize
        views[array.name] = whole.as_strided(array.shape, array.strides, first)
        if array.shape and array.shape[-1] < array.full:
            narrow.append((array.name, array.full))
    return views, tuple(narrow)


def encode_step(
    kind: str,
    inputs: Mapping[str, torch.Tensor | _PyArray],
    context: StepContext | None,
    *,
    step: int = 0,
    columns: Mapping[str, int] | None = None,
    pin: bool = False,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> StepMessage:
    """``inputs`` (CPU tensors for speed; device tensors are copied to the host first; or
    ``array.array`` of ints, type code ``q`` or ``i``) and ``context`` as one buffer. ``columns``: name
    -> how many leading columns of that 2-D input the step reads; the rest (which must be zeros) stay off
    the wire when that saves :data:`TRIM_MIN_BYTES` or more (a strided copy
    costs more than copying a few kilobytes whole). ``pin``: a pinned buffer (the step goes to a GPU).
    ``allocate``: where the buffer comes from (reused ones of a
    :class:`~devgraph.serve.engine.message_memory.MessageMemory`); a new one when absent."""
    values: list[Any] = []
    signature: list[tuple[Any, ...]] = []
    for name, tensor in inputs.items():
        if isinstance(tensor, _PyArray):  # host ints straight from Python: no torch op to make them
            typed = _ARRAY_DTYPES.get(tensor.typecode)
            if typed is None:
                raise TypeError(
                    f"step input {name}: array.array of type code {tensor.typecode!r} (use q or i)"
                )
            signature.append((name, typed, (len(tensor),), len(tensor)))
            values.append(tensor)
            continue
        if not tensor.is_cpu:
            tensor = tensor.cpu()  # correct, not fast: the engine hands host tensors to a TP forward
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        shape, dtype = tuple(tensor.shape), tensor.dtype
        full = shape[-1] if shape else 0
        if columns and name in columns and len(shape) == 2:
            kept = max(0, min(columns[name], full))
            if shape[0] * (full - kept) * dtype.itemsize >= TRIM_MIN_BYTES:
                tensor, shape = tensor[:, :kept], (shape[0], kept)
        signature.append((name, dtype, shape, full))
        values.append(tensor)
    if context is not None:
        for name in _CONTEXT_FIELDS:
            value = getattr(context, name)
            if value is not None:
                signature.append((name, None, (len(value),), len(value)))
                values.append(value)
    header, arrays, size = _plan(kind, tuple(signature))
    buffer = allocate(size) if allocate is not None else torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    base = int(buffer.data_ptr())
    ctypes.memmove(base, header, len(header))
    view = _bytes_view(buffer)
    _STEP.pack_into(view, _STEP_AT, step)
    for array, value in zip(arrays, values, strict=True):
        if array.role == _CONTEXT:
            struct.pack_into(f"<{len(value)}q", view, array.offset, *value)
        elif isinstance(value, _PyArray):
            if array.nbytes:
                ctypes.memmove(base + array.offset, value.buffer_info()[0], array.nbytes)
        elif value.is_contiguous():
            ctypes.memmove(base + array.offset, value.data_ptr(), array.nbytes)
        else:  # a column slice: one strided copy into its place
            whole = buffer.view(array.dtype)
            whole.as_strided(array.shape, array.strides, array.offset // array.dtype.itemsize).copy_(value)
    return StepMessage(kind, step, buffer, arrays)


@functools.lru_cache(maxsize=256)
def _plan(kind: str, signature: tuple[tuple[Any, ...], ...]) -> tuple[bytes, tuple[_Array, ...], int]:
    """The header and descriptors (step number 0), the arrays and the message size for one signature:
    (name, dtype or None for a context field, shape as sent, full last dim) per array. Cached: a server
    repeats a few dozen step shapes."""
    arrays = []
    offset = _aligned(_HEADER.size + _ARRAY.size * len(signature))
    for name, dtype, shape, full in signature:
        role = _INPUT if dtype is not None else _CONTEXT
        dtype = dtype if dtype is not None else torch.int64
        if len(shape) > 4 or dtype not in _CODES:
            raise TypeError(f"step input {name}: {dtype} of {len(shape)} dims cannot go on the wire")
        arrays.append(_array(name, dtype, shape, full, role, offset))
        offset = _aligned(offset + arrays[-1].nbytes)
    header = bytearray(offset if not arrays else arrays[0].offset)
    _HEADER.pack_into(header, 0, _MAGIC, _VERSION, len(arrays), kind.encode(), 0)
    for i, array in enumerate(arrays):
        dims = (*array.shape, *(0,) * (4 - len(array.shape)))
        _ARRAY.pack_into(
            header,
            _HEADER.size + i * _ARRAY.size,
            array.name.encode(),
            _CODES[array.dtype],
            len(array.shape),
            array.role,
            *dims,
            array.full,
            array.offset,
        )
    return bytes(header), tuple(arrays), offset


def stop_message(step: int = 0) -> StepMessage:
    return encode_step(STOP, {}, None, step=step)


def decode_step(buffer: torch.Tensor) -> StepMessage:
    """The message in ``buffer`` (as :func:`encode_step` wrote it); ``ValueError`` when it is not one."""
    view = _bytes_view(buffer)
    if len(view) < _HEADER.size:
        raise ValueError(f"a step message of {len(view)} bytes is shorter than its header")
    magic, version, count, kind, step = _HEADER.unpack_from(view, 0)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError(f"not a step message of format {_VERSION} (magic {magic!r}, version {version})")
    end = _HEADER.size + count * _ARRAY.size
    if end > len(view):
        raise ValueError(f"a step message of {len(view)} bytes is shorter than its {count} descriptors")
    arrays = _layout(bytes(view[_HEADER.size : end]), len(view))
    return StepMessage(kind.rstrip(b"\0").decode(), step, buffer, arrays)


@functools.lru_cache(maxsize=256)
def _layout(descriptors: bytes, size: int) -> tuple[_Array, ...]:
    """The arrays the descriptors describe (cached: steps of one shape repeat their layout)."""
    arrays = []
    for at in range(0, len(descriptors), _ARRAY.size):
        name, code, dims, role, *shape, full, offset = _ARRAY.unpack_from(descriptors, at)
        array = _array(name.rstrip(b"\0").decode(), _DTYPES[code], tuple(shape[:dims]), full, role, offset)
        if array.offset + array.nbytes > size:
            raise ValueError(f"step array {array.name} runs past the end of its message")
        arrays.append(array)
    return tuple(arrays)
