"""Static input buffers: validating a step's inputs, copying them in and padding each axis.

Every path of :meth:`GraphRunner.run` (graph or eager) validates a step the same way, before anything is
written, so ``disabled`` differs from graph mode only in speed.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from devgraph.contract.inputs import EDGE, StaticInput
from devgraph.contract.keys import REQUESTS, TOKENS, Batch, GraphKey
from devgraph.errors import InputError
from devgraph.messages import shorten
from devgraph.runner.options import RunnerPlan

__all__ = ["StaticBuffers", "StepValidator", "leading_rows"]


def _count(value: Any, what: str) -> int:
    """A non-negative Python int from ``value`` (an int or an object with ``__index__``, not a tensor)."""
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise InputError(f"{what} must be a Python int, got {shorten(value)} ({type(value).__name__})")
    count = operator.index(value)
    if count < 0:
        raise InputError(f"{what} must be >= 0, got {count}")
    return count


class StepValidator:
    """Checks a step's inputs against the plan's :class:`StaticInput` s and derives its counts.

    ``tokens_per_request`` is set for uniform phases (decode: 1, verify: ``1 + k``): the request count
    then follows from ``n``.
    """

    def __init__(self, plan: RunnerPlan) -> None:
        specs = plan.inputs
        self.phase = plan.phase
        self.specs = dict(specs)
        self.device = plan.device
        self.tokens_per_request = plan.tokens_per_request
        self.variants = dict(plan.schedule.variants)
        self.axes = tuple(sorted({s.axis for s in specs.values()} - {TOKENS}))
        self._names = frozenset(specs)
        self._first_of_axis = {
            axis: next(name for name, s in specs.items() if s.axis == axis)
            for axis in {s.axis for s in specs.values()}
        }

    def validate(
        self,
        n: Any,
        counts: Mapping[str, Any] | None,
        variant: Mapping[str, Any] | None,
        inputs: Mapping[str, Any],
    ) -> tuple[Batch, dict[str, Any]]:
        """The validated :class:`~devgraph.contract.keys.Batch` (no key yet) and variant; :class:`InputError`
        before anything is written."""
        if inputs.keys() != self._names:
            missing = sorted(self._names - inputs.keys())
            extra = sorted(inputs.keys() - self._names)
            raise InputError(
                f"{self.phase} runner inputs do not match its StaticInputs: missing {missing}, "
                f"unexpected [{', '.join(shorten(e, 30) for e in extra)}]; pass exactly {sorted(self._names)}"
            )
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor):
                raise InputError(
                    f"{self.phase} input {name!r} must be a torch.Tensor, got {type(value).__name__}; "
                    "convert lists with torch.tensor(..., dtype=..., device=...)"
                )
            if value.dim() == 0:
                raise InputError(
                    f"{self.phase} input {name!r} is a 0-dim tensor; every input has a leading dimension "
                    f"of one row per entry of its axis ({self.specs[name].axis})"
                )
        step = self._counts(n, counts, inputs)
        for name, value in inputs.items():
            self._check_tensor(name, value, step.counts)
        return step, self._variant(variant)

    def validate_counts(
        self, n: Any, counts: Mapping[str, Any] | None, variant: Mapping[str, Any] | None
    ) -> tuple[Batch, dict[str, Any]]:
        """A step's counts before its inputs exist (``agree()``): ``n`` and each other axis's count given."""
        tpr = self.tokens_per_request
        missing = [
            a for a in self.axes if a not in (counts or {}) and not (tpr is not None and a == REQUESTS)
        ]
        if n is None or missing:
            raise InputError(
                f"{self.phase} agree() takes the step's counts, not its inputs: pass n= and counts= for "
                f"{missing or 'every axis'}"
            )
        return self._counts(n, counts, {}), self._variant(variant)

    def _counts(self, n: Any, counts: Mapping[str, Any] | None, inputs: Mapping[str, torch.Tensor]) -> Batch:
        given = dict(counts or {})
        unknown = sorted(set(given) - set(self.axes))
        if unknown:
            raise InputError(
                f"{self.phase} run() got counts for unknown axes {unknown}; "
                f"this runner's other axes are {list(self.axes) or 'none'}"
            )
        if n is None:
            first = self._first_of_axis.get(TOKENS)
            if first is None:
                raise InputError(f"{self.phase} run() needs n= (no input follows the tokens axis)")
            n = inputs[first].shape[0] - self.specs[first].extra_rows
        n = _count(n, f"{self.phase} run() n")
        if n == 0:
            raise InputError(f"{self.phase} run() got n=0: a step needs at least one row")
        resolved = {TOKENS: n}
        tpr = self.tokens_per_request
        if tpr is not None and n % tpr:
            raise InputError(
                f"{self.phase} steps carry {tpr} tokens per request, "
                f"so n must be a multiple of {tpr}; got {n}"
            )
        for axis in self.axes:
            if axis in given:
                resolved[axis] = _count(given[axis], f"{self.phase} run() counts[{axis!r}]")
            elif tpr is not None and axis == REQUESTS:
                resolved[axis] = n // tpr
            else:
                first = self._first_of_axis[axis]
                resolved[axis] = inputs[first].shape[0] - self.specs[first].extra_rows
            if tpr is not None and axis == REQUESTS and resolved[axis] != n // tpr:
                raise InputError(
                    f"{self.phase} step of {n} tokens at {tpr} per request has {n // tpr} requests, "
                    f"not {resolved[axis]}"
                )
        return Batch(n, counts=resolved)

    def _check_tensor(self, name: str, value: torch.Tensor, counts: Mapping[str, int]) -> None:
        spec = self.specs[name]
        rows = spec.rows(counts[spec.axis])
        device = torch.device("cpu") if spec.host else self.device
        if (
            value.dtype != spec.dtype
            or not _same_device(value.device, device)
            or value.shape[0] != rows
            or tuple(value.shape[1:]) != spec.shape
        ):
            expected = f"{spec.dtype} on {device} with shape {(rows, *spec.shape)}"
            got = f"{value.dtype} on {value.device} with shape {tuple(value.shape)}"
            count = f"{spec.axis}={counts[spec.axis]}" + (f" + {spec.extra_rows}" if spec.extra_rows else "")
            raise InputError(
                f"{self.phase} input {name!r}: expected {expected} ({count}), got {got}; nothing was written"
            )

    def _variant(self, variant: Mapping[str, Any] | None) -> dict[str, Any]:
        chosen = dict(variant or {})
        if chosen.keys() != self.variants.keys():
            missing = sorted(self.variants.keys() - chosen.keys())
            extra = sorted(map(str, chosen.keys() - self.variants.keys()))
            raise InputError(
                f"{self.phase} run() variant= must name every declared variant {sorted(self.variants)}: "
                f"missing {missing}, unexpected {extra}"
            )
        return chosen


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def leading_rows(buf: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``buf`` as a tensor sharing its storage but with no ``_base``.

    A plain slice is a view, and torch.compile guards on a view's base: every captured size (and the
    eager fallback with the caller's own tensors) would then recompile. An alias made with ``set_`` looks
    like any other tensor to dynamo while still reading and writing the static buffer.
    """
    alias = torch.empty(0, dtype=buf.dtype, device=buf.device)
    alias.set_(buf.untyped_storage(), buf.storage_offset(), (rows, *buf.shape[1:]), buf.stride())
    return alias


class StaticBuffers:
    """One static buffer per input, sized for the largest key on the input's axis."""

    def __init__(self, specs: Mapping[str, StaticInput], max_rows: Mapping[str, int], device: torch.device):
        self.specs = dict(specs)
        self.buffers: dict[str, torch.Tensor] = {}
        # Ordinary tensors even when the runner is built under torch.inference_mode(): steps may come from
        # a thread outside it, and inference tensors cannot be written there.
        with torch.inference_mode(False):
            for name, spec in specs.items():
                where = torch.device("cpu") if spec.host else device
                rows = spec.rows(max_rows[spec.axis])
                self.buffers[name] = torch.full(
                    (rows, *spec.shape), _resting(spec.fill), dtype=spec.dtype, device=where
                )
        # (name, buffer, axis, extra rows, fill) in declaration order: the per-step loop reads only this.
        self._plan = tuple(
            (name, self.buffers[name], spec.axis, spec.extra_rows, spec.fill) for name, spec in specs.items()
        )

    def views(self, key: GraphKey) -> dict[str, torch.Tensor]:
        """Per-input aliases of the rows ``key`` covers, new ones each call (a forward that changes an
        input's metadata in place, ``x.unsqueeze_(0)``, changes only the aliases it was given)."""
        return {name: leading_rows(buf, extra + key.size(axis)) for name, buf, axis, extra, _ in self._plan}

    def rows_of(self, name: str, rows: int) -> torch.Tensor | None:
        """``name``'s first ``rows`` rows (``GraphRunner.static_rows``); ``None``: no such buffer or rows."""
        buf = self.buffers.get(name)
        if buf is None or isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= buf.shape[0]:
            return None
        # A plain slice (one view op): it is written and handed to run(), never traced by a compiler
        # (an eager step's forward gets a copy of it)
        return buf[:rows]

    def stage(self, counts: Mapping[str, int], key: GraphKey, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy validated inputs into the buffers and pad every axis up to ``key`` with its fill. An input
        that already is the buffer's rows (written there through ``rows_of``) is not copied."""
        # No autograd: an input that requires grad must not chain the static buffer to its graph.
        with torch.no_grad():
            for name, buf, axis, extra, fill in self._plan:
                real = counts[axis] + extra
                padded = key.size(axis) + extra
                value = inputs[name]
                if not _is_rows_of(value, buf):
                    buf[:real].copy_(value)
                if real < padded:
                    _pad(buf, real, padded, fill)

    def reset(self) -> None:
        """Every row back to its fill (capture runs on harmless rows only)."""
        for _, buf, _, _, fill in self._plan:
            buf.fill_(_resting(fill))

    def clear(self) -> None:
        self.buffers = {}
        self._plan = ()


def _is_rows_of(value: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``value`` (validated: ``buf``'s dtype and row shape) lies exactly on ``buf``'s first rows."""
    if value.data_ptr() != buf.data_ptr() or value.device != buf.device:
        return False
    if value.stride()[1:] != buf.stride()[1:]:
        return False
    return value.shape[0] <= 1 or value.stride(0) == buf.stride(0)


def _resting(fill: Any) -> int | float | bool:
    """The value a row holds when no step wrote it: the fill, or 0 for ``"edge"`` (no row to repeat)."""
    return 0 if isinstance(fill, str) else fill


def _pad(buf: torch.Tensor, real: int, padded: int, fill: Any) -> None:
    if fill == EDGE:
        if real:
            buf[real:padded].copy_(buf[real - 1 : real].expand(padded - real, *buf.shape[1:]))
        else:
            buf[:padded].zero_()
    else:
        buf[real:padded].fill_(fill)
