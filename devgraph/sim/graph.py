"""Simulated device graphs on the CPU: record every aten op at capture, re-run them at replay.

A :class:`SimGraph` behaves like a CUDA graph so that every graph strategy can be tested without a GPU:

* Capture records each aten op dispatched on the capturing thread (through :class:`SimRecorder`, a
  ``TorchDispatchMode``) with strong references to its arguments and results. The op also runs normally.
* Replay re-runs the recorded ops **on the same tensors**. Results of ops that allocate are copied back
  into the tensors captured first, so outputs keep their identity and ``data_ptr``; view ops are not
  re-run (the captured view still aliases the same storage); ops that write are re-run as they are. A
  caller who writes into a captured input sees the new value flow through; one who rebinds a name to a
  new tensor gets stale results, exactly as on a device.
* A custom op with a Python body (``torch.library.custom_op``, so every ``graph_break`` op) is captured
  the way a device captures it: its body runs once and the aten ops it issues are recorded, so Python
  state it read at capture (the forward context, a host scalar) is baked into the graph. A custom op
  with a C++ kernel is recorded, and re-run, as one op.
* Capture enforces the device rules: an op that syncs with the host (``.item()``, ``.tolist()``,
  ``bool(t)``, ``torch.equal``) or whose output shape depends on tensor data (``nonzero``,
  ``masked_select``, ``unique``, boolean-mask indexing) raises :class:`~devgraph.errors.CaptureError`,
  as does a capture nested in another.

A note on failed captures: a ``TorchDispatchMode`` handler runs with its own mode popped, and torch
pushes the mode back after the handler returns or raises, so a mode can never leave the stack from
inside its own handler. Python-level calls are therefore also watched by a ``TorchFunctionMode``,
which removes the recorder once the error has left the dispatcher. That outer mode (and a recorder
that failed where no Python-level call surrounded it) stays on its stack as an inert pass-through until
the next capture call on the thread (``capture_begin``, ``capture_end``, ``abort_capture``, ``reset``,
``record_opaque``) removes it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:  # torch >= 2.4: ops made by torch.library.custom_op, whose kernel is a Python function
    from torch._library.custom_ops import _maybe_get_opdef
except ImportError:  # pragma: no cover - older torch: every custom op is recorded as one op
    _maybe_get_opdef = None

from devgraph.errors import CaptureError, ReplayError

__all__ = [
    "SimGraph",
    "SimPool",
    "SimRecorder",
    "abort_capture",
    "begin_capture",
    "end_capture",
    "is_capturing",
    "record_opaque",
    "reserved_bytes",
]

Step = Callable[[], None]
# One segment of a finalized graph: (run with the kernel dispatch keys?, steps, step names).
_Segment = tuple[bool, tuple[Step, ...], tuple[str, ...]]
_Target = tuple[int, int | None, torch.Tensor]


# -- thread state ------------------------------------------------------------------------------------
class _ThreadState(threading.local):
    """Per-thread capture state: like a device stream capture, a sim capture belongs to one thread."""

    def __init__(self) -> None:
        self.capture: _Capture | None = None
        # True while an op recorded as a whole runs: what it issues internally belongs to it and must
        # not be recorded or checked again.
        self.in_op = False
        # How many of our mode handlers are running on this thread. A handler's own mode is off its
        # stack until the handler returns, so a finished mode can only be known gone at depth 0.
        self.depth = 0
        # Modes of finished captures that may still be on (or come back onto) a stack: (mode, dispatch?).
        self.retired: list[tuple[Any, bool]] = []


_tls = _ThreadState()


# -- memory accounting -------------------------------------------------------------------------------
_LIVE_POOLS: weakref.WeakSet[SimPool] = weakref.WeakSet()


class SimPool:
    """The memory pool sim graphs are captured into: the CPU stand-in for a device graph pool handle.

    It only does the accounting. Each graph registers the storages its ops allocated during capture
    (and that replay keeps alive); :attr:`nbytes` sums them, counting each storage once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storages: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, graphs holding it]
        self._graphs = 0
        _LIVE_POOLS.add(self)

    @property
    def nbytes(self) -> int:
        """Bytes held by the graphs captured into this pool."""
        with self._lock:
            return sum(entry[0] for entry in self._storages.values())

    @property
    def num_graphs(self) -> int:
        """How many live graphs hold memory from this pool."""
        return self._graphs

    def _hold(self, storages: dict[int, int]) -> None:
        with self._lock:
            self._graphs += 1
            for ptr, nbytes in storages.items():
                entry = self._storages.setdefault(ptr, [nbytes, 0])
                entry[1] += 1

    def _release(self, storages: dict[int, int]) -> None:
        with self._lock:
            self._graphs -= 1
            for ptr in storages:
                entry = self._storages.get(ptr)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._storages[ptr]

    def __repr__(self) -> str:
        return f"SimPool(graphs={self._graphs}, nbytes={self.nbytes})"


def reserved_bytes() -> int:
    """Bytes held by every live sim graph in this process."""
    return sum(pool.nbytes for pool in list(_LIVE_POOLS))


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """``(data_ptr, nbytes)`` of the storage under ``tensor`` (``(0, 0)`` when it has none)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return 0, 0
    return storage.data_ptr(), storage.nbytes()


def _tensors_in(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor among ``values``, looking one level into lists and tuples (aten's ``Tensor[]``)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _input_storages(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    return {_storage_of(t)[0] for t in _tensors_in((*args, *kwargs.values()))} - {0}


# -- capture rules -----------------------------------------------------------------------------------
class _Violation(NamedTuple):
    what: str  # what the op does wrong, e.g. "syncs with the host"
    advice: str


_Rule = Callable[[tuple[Any, ...], dict[str, Any]], _Violation | None]

_HOST_SYNC = "syncs with the host"
_DYNAMIC_SHAPE = "has a data-dependent output shape (a device syncs with the host to size it)"
_SCALAR_ADVICE = "move it out of the captured forward or read the value from the forward context"
_MOVE_OUT = "move it out of the captured forward"
_MASK_ASSIGN = "use x.masked_fill_(mask, v) instead of boolean-mask assignment (`x[mask] = v`)"
_MASK_DTYPES = (torch.bool, torch.uint8)


def _always(what: str, advice: str) -> _Rule:
    violation = _Violation(what, advice)
    return lambda args, kwargs: violation


def _when_bool_index(what: str, advice: str) -> _Rule:
    """Indexing with a boolean mask hides a ``nonzero``; integer indices keep the shape static."""
    violation = _Violation(what, advice)

    def rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Violation | None:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masked = any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices)
        return violation if masked else None

    return rule


def _when_output_size_missing(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Violation | None:
    if kwargs.get("output_size") is None:
        return _Violation(
            _DYNAMIC_SHAPE, "pass output_size=... so the output shape is known without reading `repeats`"
        )
    return None


def _when_num_classes_missing(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Violation | None:
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if num_classes < 0:
        return _Violation(_DYNAMIC_SHAPE, "pass num_classes=... so the output shape is known")
    return None


_UNIQUE = _always(_DYNAMIC_SHAPE, "compute it outside the captured forward and pass it in as a static input")
_COMPARE = _always(
    _HOST_SYNC,
    "it returns a Python bool: keep the comparison on the device (e.g. `torch.eq(a, b).all()`) "
    "or move it out of the captured forward",
)

# Keyed by overload name, else by overload packet name; a rule here overrides the op's tags
# (``aten.index`` is tagged dynamic_output_shape, but only boolean-mask indexing really is).
_RULES: dict[str, _Rule] = {
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
    "aten.index_put": _when_bool_index(_HOST_SYNC, _MASK_ASSIGN),
    "aten.index_put_": _when_bool_index(_HOST_SYNC, _MASK_ASSIGN),
    "aten._index_put_impl_": _when_bool_index(_HOST_SYNC, _MASK_ASSIGN),
}

_SCALAR_READS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.is_nonzero"})

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


@dataclass(frozen=True)
class _OpInfo:
    """What capture and replay need to know about one op overload (computed once per overload)."""

    name: str  # overload packet name, e.g. "aten.add"; the ``op`` of a CaptureError
    mutable: bool  # writes an argument: always re-run
    # Per schema return: not one the op writes in place. Such a return is copied back at replay when
    # it is really new storage; one that shares an input's storage is a view and stays a view.
    readable: tuple[bool, ...]
    single: bool  # one schema return, so the result is not a tuple of returns
    allocation: bool  # an empty-family op: its contents are undefined
    builtin: bool  # an aten/prims op: no effect beyond its schema
    python_body: bool  # a torch.library.custom_op: its Python kernel is traced, not recorded whole
    rule: _Rule | None


_OP_INFO: dict[Any, _OpInfo] = {}
_DATA_DEPENDENT_TAG = getattr(torch.Tag, "data_dependent_output", None)
_DYNAMIC_SHAPE_TAG = getattr(torch.Tag, "dynamic_output_shape", None)


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = _classify(func)
    return info


def _classify(func: Any) -> _OpInfo:
    schema = func._schema
    returns = schema.returns
    name = str(func._overloadpacket)
    builtin = func.namespace in ("aten", "prims")
    rule = _RULES.get(str(func)) or _RULES.get(name)
    if rule is None:
        tags = getattr(func, "tags", ())
        if _DATA_DEPENDENT_TAG is not None and _DATA_DEPENDENT_TAG in tags:
            rule = _always(_HOST_SYNC, _MOVE_OUT)
        elif _DYNAMIC_SHAPE_TAG is not None and _DYNAMIC_SHAPE_TAG in tags:
            rule = _always(_DYNAMIC_SHAPE, _MOVE_OUT)
    return _OpInfo(
        name=name,
        mutable=schema.is_mutable,
        readable=tuple(r.alias_info is None or not r.alias_info.is_write for r in returns),
        single=len(returns) == 1,
        allocation=name in _ALLOCATIONS,
        builtin=builtin,
        python_body=not builtin and _maybe_get_opdef is not None and _maybe_get_opdef(func) is not None,
        rule=rule,
    )


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


def _violation_error(info: _OpInfo, violation: _Violation, api: Any) -> CaptureError:
    if info.name in _SCALAR_READS:
        shown = _SCALAR_CALLS.get(getattr(api, "__name__", ""), "")
        subject = (
            f"{shown} ({info.name})"
            if shown
            else f"{info.name} (`.item()`, `.tolist()`, `int(t)`, `float(t)` or `bool(t)`)"
        )
    elif api is None or isinstance(api, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        subject = info.name  # called as torch.ops.*: the op name says it all
    else:
        subject = f"`{_api_name(api)}` ({info.name})"
    message = f"{subject} {violation.what} and cannot be captured; {violation.advice}"
    return CaptureError(message, op=info.name)


def _host_read_calls() -> dict[Any, tuple[str, str, str]]:
    """Python-level calls that read tensor memory on the host without dispatching an aten op,
    as (how the user wrote it, the op to report, what it does)."""
    numpy_read = "reads tensor memory on the host"
    return {
        torch.Tensor.tolist: ("`.tolist()`", "aten._local_scalar_dense", _HOST_SYNC),
        torch.Tensor.numpy: ("`.numpy()`", "Tensor.numpy", numpy_read),
        torch.Tensor.__array__: ("`numpy.asarray(t)`", "Tensor.numpy", numpy_read),
    }


_HOST_READ_CALLS = _host_read_calls()


# -- mode stacks -------------------------------------------------------------------------------------
def _top_mode(dispatch: bool) -> Any:
    if dispatch:
        length = torch._C._len_torch_dispatch_stack()
        return torch._C._get_dispatch_stack_at(length - 1) if length else None
    length = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(length - 1) if length else None


def _on_stack(mode: Any, dispatch: bool) -> bool:
    if dispatch:
        length, get_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
    else:
        length, get_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
    return any(get_at(i) is mode for i in range(length()))


def _remove_mode(mode: Any, dispatch: bool) -> bool:
    """Take ``mode`` off its stack wherever it is; ``False`` if it is not there (popped for its handler).

    Modes entered above it (left over by code that did not exit them) are put back in order.
    ``__exit__`` does the final pop so that torch's bookkeeping of active dispatch modes stays right.
    """
    if not _on_stack(mode, dispatch):
        return False
    if dispatch:
        pop, push = (lambda: torch._C._pop_torch_dispatch_stack(None)), torch._C._push_on_torch_dispatch_stack
    else:
        pop, push = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack
    above = []
    while True:
        top = pop()
        if top is mode:
            push(mode)
            mode.__exit__(None, None, None)
            break
        above.append(top)
    for other in reversed(above):
        push(other)
    return True


def _retire(capture: _Capture) -> None:
    """Make the capture's modes inert and take them off their stacks (now, or at a later sweep)."""
    capture.recorder.capture = None
    capture.guard.capture = None
    _tls.retired.extend(((capture.recorder, True), (capture.guard, False)))
    _sweep_retired()


def _sweep_retired() -> None:
    """Take retired modes off their stacks; forget them once no handler of ours can push one back."""
    retired = _tls.retired
    if not retired:
        return
    for mode, dispatch in retired:
        while _remove_mode(mode, dispatch):
            pass
    if _tls.depth == 0:
        retired.clear()


def _settle_failed() -> _Capture | None:
    """Finish this thread's capture if a capture rule ended it; return it (for its error) or ``None``."""
    _sweep_retired()
    capture = _tls.capture
    if capture is None or capture.error is None:
        return None
    _tls.capture = None
    return capture


def _keys_below_python(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The dispatch keys of the arguments' tensors that come after the Python key (backend keys)."""
    keys = None
    for tensor in _tensors_in((*args, *kwargs.values())):
        tensor_keys = torch._C._dispatch_keys(tensor)
        keys = tensor_keys if keys is None else keys | tensor_keys
    if keys is None:
        return None
    return keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


# -- capture -----------------------------------------------------------------------------------------
class SimRecorder(TorchDispatchMode):
    """The dispatch mode that records aten ops into the capture in progress on this thread.

    It is entered by :func:`begin_capture` and exited by :func:`end_capture`; do not enter it directly.
    """

    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture: _Capture | None = capture

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        if capture is None or capture.paused:
            return func(*args, **kwargs)
        state = _tls
        state.depth += 1
        try:
            return capture.on_op(func, args, kwargs)
        finally:
            state.depth -= 1


class _HostReadGuard(TorchFunctionMode):
    """Sees the Python-level calls of a capture: ``.tolist()`` and ``.numpy()`` (which dispatch no op),
    the name of the call that led to a failing op (for the error), and a place to take the recorder off
    the dispatch stack once an error has left it."""

    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture: _Capture | None = capture

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        state = _tls
        if capture is None or capture.paused or state.in_op:
            return func(*args, **kwargs)
        state.depth += 1
        try:
            return capture.on_call(func, args, kwargs)
        finally:
            state.depth -= 1


class _Capture:
    """One capture in progress on one thread."""

    def __init__(self, graph: SimGraph, pool: SimPool) -> None:
        self.graph = graph
        self.pool = pool
        self.steps: list[tuple[bool, Step, str]] = []  # (kernel step?, step, name) in issue order
        self.storages: dict[int, int] = {}  # storages allocated by recorded ops: data_ptr -> nbytes
        self.keepalive: list[torch.Tensor] = []  # allocations replay does not redo but must keep
        self.kernel_keys: tuple[Any, Any] | None = None
        self.api: Any = None  # the Python-level call being run, for error messages
        self.paused = False
        self.error: CaptureError | None = None
        self.recorder = SimRecorder(self)
        self.guard = _HostReadGuard(self)

    # -- lifecycle ---------------------------------------------------------------------------------
    def enter(self) -> None:
        self.guard.__enter__()
        try:
            self.recorder.__enter__()
        except BaseException:
            self.guard.__exit__(None, None, None)
            raise

    def close(self) -> None:
        """Leave both mode stacks and drop the modes' links to this capture."""
        _retire(self)

    def fail(self, error: CaptureError) -> NoReturn:
        """End the capture because a capture rule was broken, leave the graph empty and raise ``error``."""
        self.error = error
        self.steps.clear()
        self.storages.clear()
        self.keepalive.clear()
        self.graph._capture_failed(error)
        _retire(self)  # takes off the modes on a stack now; the one whose handler runs comes back later
        raise error

    # -- recording ---------------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = _op_info(func)
        if info.rule is not None:
            violation = info.rule(args, kwargs)
            if violation is not None:
                self.fail(_violation_error(info, violation, self.api))
        if info.python_body:
            keys = _keys_below_python(args, kwargs)
            if keys is not None:
                return self._trace_body(func, keys, args, kwargs)
        state = _tls
        previous, state.in_op = state.in_op, True
        try:
            out = func(*args, **kwargs)
        finally:
            state.in_op = previous
        if self.kernel_keys is None:
            # The dispatch keys in force inside the handler (autograd, ADInplaceOrView and autocast
            # excluded): replay re-runs the ops under the same keys, as kernels, not as new autograd
            # calls; that also lets inference tensors be written outside inference mode.
            self.kernel_keys = (
                torch._C._dispatch_tls_local_include_set(),
                torch._C._dispatch_tls_local_exclude_set(),
            )
        self._record_op(func, info, args, kwargs, out)
        return out

    def _trace_body(self, func: Any, keys: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a Python custom op's kernel with the modes back on their stacks, so that the ops its body
        issues are checked and recorded one by one, as a device captures the kernels they launch.

        ``redispatch`` below the Python key reaches the kernel without coming back to this handler.
        """
        push_guard = not _on_stack(self.guard, dispatch=False)
        if push_guard:
            self.guard.__enter__()
        self.recorder.__enter__()
        try:
            return func.redispatch(keys, *args, **kwargs)
        finally:
            if self.error is None:  # a failure has retired (and removed) the modes already
                _remove_mode(self.recorder, True)
                if push_guard:
                    _remove_mode(self.guard, False)

    def _record_op(
        self, func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        targets = self._fresh_targets(info, args, kwargs, out)
        if info.allocation:
            self.keepalive.extend(t for _, _, t in targets)
            return
        if not targets and not info.mutable and info.builtin:
            return  # views (the captured view keeps aliasing its input) or metadata: nothing to redo
        self.steps.append((True, _op_step(func, args, kwargs, targets, info.single), str(func)))

    def _fresh_targets(
        self, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> list[_Target]:
        """The newly allocated tensors ``out`` holds, as (return index, list index, tensor).

        The storage decides, not the schema alone: ``reshape``, ``contiguous`` and ``to`` are annotated
        as aliases but copy when they must (they reach the mode whole where autograd is off), and
        ``_unsafe_view`` is annotated as new but is a view.
        """
        if not any(info.readable):
            return []
        values = (out,) if info.single else out
        inputs: set[int] | None = None
        targets: list[_Target] = []
        for i, readable in enumerate(info.readable):
            value = values[i]
            if not readable or value is None:
                continue
            items = [(None, value)] if isinstance(value, torch.Tensor) else list(enumerate(value))
            for j, tensor in items:
                if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                    continue
                ptr, nbytes = _storage_of(tensor)
                if inputs is None:
                    inputs = _input_storages(args, kwargs)
                if ptr in inputs:
                    continue  # a view of an input: it sees every replayed write to that input
                if ptr:
                    self.storages[ptr] = nbytes
                targets.append((i, j, tensor))
        return targets

    def on_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            host_read = _HOST_READ_CALLS.get(func)
        except TypeError:  # an unhashable callable cannot be one of them
            host_read = None
        if host_read is not None:
            shown, op, what = host_read
            self.fail(
                CaptureError(
                    f"{shown} ({op}) {what} and cannot be captured; {_SCALAR_ADVICE} "
                    "(code that must run on the host at every replay can go in platform.record_opaque)",
                    op=op,
                )
            )
        previous, self.api = self.api, func
        try:
            return func(*args, **kwargs)
        except CaptureError:
            if self.error is not None:
                # The recorder raised inside this call and torch has pushed it back since; it can leave now.
                _sweep_retired()
            raise
        finally:
            self.api = previous

    def run_opaque(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._suspended():
            result = fn(*args, **kwargs)
        inputs = _input_storages(args, kwargs)
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                ptr, nbytes = _storage_of(tensor)
                if ptr and ptr not in inputs:
                    self.storages[ptr] = nbytes
        name = getattr(fn, "__qualname__", None) or repr(fn)
        self.steps.append((False, _opaque_step(fn, args, kwargs, result), f"opaque:{name}"))
        return result

    @contextlib.contextmanager
    def _suspended(self) -> Iterator[None]:
        """Stop recording; also leave the mode stacks when on top, so compiled code runs as compiled
        (dynamo runs frames eagerly while a dispatch mode is on the stack)."""
        self.paused = True
        on_top = _top_mode(True) is self.recorder and _top_mode(False) is self.guard
        if on_top:
            self.recorder.__exit__(None, None, None)
            self.guard.__exit__(None, None, None)
        try:
            yield
        finally:
            if on_top:
                self.guard.__enter__()
                self.recorder.__enter__()
            self.paused = False

    def program(self) -> tuple[_Segment, ...]:
        """Group the recorded steps into runs of one kind (kernel ops / opaque calls) for replay."""
        segments: list[_Segment] = []
        for kernel, group in itertools.groupby(self.steps, key=lambda entry: entry[0]):
            entries = list(group)
            segments.append((kernel, tuple(e[1] for e in entries), tuple(e[2] for e in entries)))
        return tuple(segments)


# -- replay steps ------------------------------------------------------------------------------------
def _op_step(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], targets: list[_Target], single: bool
) -> Step:
    """A closure that re-runs ``func`` on the captured arguments and copies fresh results back."""
    call = getattr(func, "_op", func)  # the C++ entry point: skips OpOverload.__call__'s Python frame
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


def _opaque_step(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Step:
    """A closure that calls ``fn`` again and copies its tensor results into the captured ones."""
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


# -- the graph ---------------------------------------------------------------------------------------
class SimGraph:
    """A captured sequence of ops that replays on the same tensors: the CPU stand-in for a CUDA graph.

    Capture with :meth:`CpuSimPlatform.capture_begin` / ``capture_end`` (or the methods here), then
    :meth:`replay` as often as needed; :meth:`reset` drops everything the graph holds.
    """

    def __init__(self) -> None:
        self._program: tuple[_Segment, ...] | None = None
        self._kernel_keys: tuple[Any, Any] | None = None
        self._keepalive: tuple[torch.Tensor, ...] = ()
        self._pool: SimPool | None = None
        self._nbytes = 0
        self._release: weakref.finalize | None = None
        self._capturing_thread: int | None = None
        self._failure: str | None = None  # the message only: the error's traceback holds frames

    # -- capture -----------------------------------------------------------------------------------
    def capture_begin(self, pool: SimPool | None = None) -> None:
        """Start capturing into this graph on the current thread (see :func:`begin_capture`)."""
        begin_capture(self, pool)

    def capture_end(self) -> None:
        """Finish the capture started by :meth:`capture_begin`."""
        end_capture(self)

    def _start_capture(self) -> None:
        if self._capturing_thread is not None:
            raise CaptureError(f"{self!r} is already capturing on another thread")
        if self._program is not None:
            raise CaptureError(f"{self!r} already holds a capture; call reset() before capturing into it")
        self._failure = None
        self._capturing_thread = threading.get_ident()

    def _finish_capture(self, capture: _Capture) -> None:
        self._capturing_thread = None
        self._program = capture.program()
        self._kernel_keys = capture.kernel_keys
        self._keepalive = tuple(capture.keepalive)
        self._pool = capture.pool
        storages = dict(capture.storages)
        self._nbytes = sum(storages.values())
        capture.pool._hold(storages)
        # A graph dropped without reset() frees its tensors, so its bytes must leave the pool too.
        self._release = weakref.finalize(self, capture.pool._release, storages)

    def _capture_failed(self, error: CaptureError) -> None:
        self._capturing_thread = None
        self._failure = str(error)

    # -- DeviceGraph -------------------------------------------------------------------------------
    def replay(self) -> None:
        """Re-run the captured ops on the captured tensors.

        Raises :class:`~devgraph.errors.ReplayError` if the graph holds no capture, or wrapping the
        error of the step that failed.
        """
        program = self._program
        if program is None:
            raise ReplayError(self._why_not_replayable())
        capture = _tls.capture
        if capture is not None and capture.error is None and not capture.paused and not _tls.in_op:
            # Replayed while another graph captures: record it there as one step (a child graph).
            capture.run_opaque(self._run, (program,), {})
            return
        self._run(program)

    def _run(self, program: tuple[_Segment, ...]) -> None:
        keys = self._kernel_keys
        step: Step | None = None
        try:
            for kernel, steps, _ in program:
                if kernel and keys is not None:
                    with torch._C._ForceDispatchKeyGuard(*keys):
                        for step in steps:
                            step()
                else:
                    for step in steps:
                        step()
        except Exception as exc:
            where = self._step_name(program, step)
            raise ReplayError(f"replaying {self!r} failed at {where}: {exc}") from exc

    @staticmethod
    def _step_name(program: tuple[_Segment, ...], step: Step | None) -> str:
        for _, steps, names in program:
            for candidate, name in zip(steps, names, strict=True):
                if candidate is step:
                    return name
        return "its first step"

    def _why_not_replayable(self) -> str:
        if self._capturing_thread is not None:
            return f"{self!r} is still capturing; call capture_end() before replay()"
        if self._failure is not None:
            return f"{self!r} holds no capture: its capture failed with: {self._failure}"
        return f"{self!r} holds no capture; capture it (or capture it again after reset()) before replay()"

    def reset(self) -> None:
        """Drop every op and tensor the graph holds so their memory can be freed; it can be captured again.

        A capture still in progress into this graph on this thread is abandoned first.
        """
        _settle_failed()
        capture = _tls.capture
        if capture is not None and capture.graph is self:
            _tls.capture = None
            capture.close()
            self._capturing_thread = None
        elif self._capturing_thread is not None:
            raise CaptureError(f"cannot reset {self!r} while another thread captures into it")
        self._program = None
        self._failure = None
        self._kernel_keys = None
        self._keepalive = ()
        self._pool = None
        self._nbytes = 0
        if self._release is not None:
            self._release()
            self._release = None

    # -- introspection -----------------------------------------------------------------------------
    @property
    def is_captured(self) -> bool:
        """Whether the graph holds a capture that :meth:`replay` can run."""
        return self._program is not None

    @property
    def op_names(self) -> tuple[str, ...]:
        """The steps replay runs, in order (ops not re-run, such as views, are not listed)."""
        return tuple(name for _, _, names in self._program or () for name in names)

    @property
    def nbytes(self) -> int:
        """Bytes of the storages this graph allocated during capture and keeps alive."""
        return self._nbytes

    @property
    def pool(self) -> SimPool | None:
        """The pool the graph was captured into, ``None`` when it holds no capture."""
        return self._pool

    def __repr__(self) -> str:
        if self._capturing_thread is not None:
            state = "capturing"
        elif self._program is not None:
            state = f"{len(self.op_names)} steps, {self._nbytes} bytes"
        else:
            state = "empty"
        return f"SimGraph({state})"


# -- module-level capture API (what CpuSimPlatform calls) --------------------------------------------
def begin_capture(graph: SimGraph, pool: SimPool | None = None) -> None:
    """Start recording the ops this thread dispatches into ``graph``, accounting memory to ``pool``.

    ``pool=None`` gives the graph a pool of its own. Raises :class:`CaptureError` if this thread is
    already capturing (captures do not nest) or ``graph`` already holds a capture.
    """
    if not isinstance(graph, SimGraph):
        raise CaptureError(f"the CPU simulator captures into a SimGraph (from new_graph()), got {graph!r}")
    if pool is not None and not isinstance(pool, SimPool):
        raise CaptureError(f"the CPU simulator needs a SimPool (from graph_pool_handle()), got {pool!r}")
    _settle_failed()
    current = _tls.capture
    if current is not None:
        raise CaptureError(
            f"nested capture: this thread is already capturing into {current.graph!r}; device graphs "
            f"cannot be captured inside one another, so call capture_end() on it before capturing {graph!r}"
        )
    graph._start_capture()
    capture = _Capture(graph, pool if pool is not None else SimPool())
    try:
        capture.enter()
    except BaseException:
        graph._capturing_thread = None
        raise
    _tls.capture = capture


def end_capture(graph: SimGraph) -> None:
    """Stop recording into ``graph`` and finalize it for replay.

    Raises :class:`CaptureError` if ``graph`` is not capturing on this thread, including when a capture
    rule already ended its capture (the error then repeats the original one).
    """
    failed = _settle_failed()
    if failed is not None and failed.graph is graph and failed.error is not None:
        raise CaptureError(
            f"the capture into {graph!r} was already ended by an error: {failed.error}", op=failed.error.op
        ) from failed.error
    capture = _tls.capture
    if capture is None or capture.graph is not graph:
        raise CaptureError(f"capture_end() on {graph!r}, which is not capturing on this thread")
    _tls.capture = None
    capture.close()
    graph._finish_capture(capture)


def abort_capture(graph: SimGraph) -> None:
    """End a capture into ``graph`` that failed half-way (if any) and reset the graph; never raises
    for a graph that is not capturing."""
    graph.reset()


def is_capturing() -> bool:
    """Whether this thread is capturing into a sim graph now."""
    capture = _tls.capture
    return capture is not None and capture.error is None


def record_opaque(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)``; while this thread captures, record the call as one replay step.

    The recorder is off while ``fn`` runs (it may run compiled code no dispatch mode sees); replay calls
    ``fn`` again with the same arguments and copies its tensor results into the captured ones.
    """
    _settle_failed()
    capture = _tls.capture
    if capture is None or capture.paused or _tls.in_op:
        # Not capturing, nested in another opaque call, or inside an op recorded as a whole.
        return fn(*args, **kwargs)
    return capture.run_opaque(fn, args, kwargs)
