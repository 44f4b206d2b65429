"""The capture in progress on a thread: checks each op against the device rules, records it as a replay
step, traces the bodies of Python custom ops op by op, records opaque calls whole, and undoes its writes
to memory that existed before it when it ends (see :mod:`devgraph.platforms.sim.graph` for the whole
picture)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch.utils._pytree import tree_leaves

from devgraph.errors import CaptureError
from devgraph.platforms.sim.device_memory import SIM_MEMORY, SimPool
from devgraph.platforms.sim.device_rules import HOST_READ_CALLS, host_read_error, violation_error
from devgraph.platforms.sim.dispatch_modes import (
    HostReadGuard,
    SimRecorder,
    keys_below_python,
    mode_state,
    on_stack,
    remove_mode,
    retire,
    sweep_retired,
    top_mode,
)
from devgraph.platforms.sim.ops import OpInfo, input_storages, op_info, storage_of, written_tensors
from devgraph.platforms.sim.snapshots import StorageSnapshots
from devgraph.platforms.sim.steps import Segment, Step, Target, op_step, opaque_step

__all__ = ["Capture", "capture_state", "settle_failed"]

#: What torch raises when an allocation fails during a CUDA graph capture (pytorch#159594): the capture is
#: invalidated by the allocator's retry path, and the out-of-memory is not mentioned.
_INVALIDATED = (
    "CUDA error: operation failed due to a previous error during capture (cudaErrorStreamCaptureInvalidated)"
)


class _CaptureState(threading.local):
    """This thread's capture in progress, if any (a capture belongs to the thread that began it)."""

    def __init__(self) -> None:
        self.capture: Capture | None = None


capture_state = _CaptureState()


class Capture:
    """One capture in progress on one thread.

    ``graph`` is the graph being captured (kept for identity and messages); ``on_fail`` is told when a
    capture rule ends the capture, before the error is raised.
    """

    def __init__(self, graph: object, pool: SimPool, on_fail: Callable[[CaptureError], None]) -> None:
        self.graph = graph
        self.pool = pool
        self.on_fail = on_fail
        self.steps: list[tuple[bool, Step, str]] = []  # (kernel step?, step, name) in issue order
        self.storages: dict[int, int] = {}  # storages allocated by recorded ops: data_ptr -> nbytes
        # When each allocated storage is first and last used, in ops seen (the pool's reuse model).
        self.lifetimes: dict[int, tuple[int, int]] = {}
        self.ops_seen = 0
        self.literals: set[int] = set()  # storages of tensors made from Python data during the capture
        self.snapshots = StorageSnapshots()  # older storages the capture wrote, as they were before
        self.keepalive: list[torch.Tensor] = []  # allocations replay does not redo but must keep
        self.kernel_keys: tuple[Any, Any] | None = None
        self.api: Any = None  # the Python-level call being run, for error messages
        self.paused = False
        self.error: CaptureError | None = None
        self.recorder = SimRecorder(self)
        self.guard = HostReadGuard(self)

    # -- lifecycle ---------------------------------------------------------------------------------
    def enter(self) -> None:
        self.guard.__enter__()
        try:
            self.recorder.__enter__()
        except BaseException:
            self.guard.__exit__(None, None, None)
            raise

    def close(self) -> None:
        """Leave both mode stacks, drop the modes' links to this capture and undo its writes to older
        memory."""
        retire(self.recorder, self.guard)
        self.snapshots.restore()

    def fail(self, error: CaptureError) -> NoReturn:
        """End the capture because a capture rule was broken, leave the graph empty, undo the capture's
        writes to older memory and raise ``error``."""
        self.error = error
        self.steps.clear()
        self.storages.clear()
        self.lifetimes.clear()
        self.literals.clear()
        self.keepalive.clear()
        self.on_fail(error)
        self.close()  # the mode whose handler runs now comes back, swept later
        raise error

    # -- recording ---------------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = op_info(func)
        if info.rule is not None:
            violation = info.rule(args, kwargs)
            if violation is not None:
                self.fail(violation_error(info.name, violation, self.api))
        if info.writes:
            self._save_written(info, args, kwargs)
        if info.python_body:
            keys = keys_below_python(args, kwargs)
            if keys is not None:
                return self._trace_body(func, keys, args, kwargs)
        state = mode_state
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
        if info.literal and isinstance(out, torch.Tensor):
            self.literals.add(storage_of(out)[0])
        self._record_op(func, info, args, kwargs, out)
        return out

    def _save_written(self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before an op writes into memory that existed before the capture, keep a copy to restore.

        Memory the capture allocated (through a recorded op, or as a tensor made from Python data) is
        the graph's own and keeps what the capture wrote into it.
        """
        for tensor in written_tensors(info, args, kwargs):
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                continue
            ptr = storage.data_ptr()
            if ptr and ptr not in self.storages and ptr not in self.literals:
                self.snapshots.save(ptr, storage)

    def _trace_body(self, func: Any, keys: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a Python custom op's kernel with the modes back on their stacks, so that the ops its body
        issues are checked and recorded one by one, as a device captures the kernels they launch.

        ``redispatch`` below the Python key reaches the kernel without coming back to this handler.
        """
        push_guard = not on_stack(self.guard, dispatch=False)
        if push_guard:
            self.guard.__enter__()
        self.recorder.__enter__()
        try:
            return func.redispatch(keys, *args, **kwargs)
        finally:
            if self.error is None:  # a failure has retired (and removed) the modes already
                remove_mode(self.recorder, True)
                if push_guard:
                    remove_mode(self.guard, False)

    def _record_op(
        self, func: Any, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        targets = self._fresh_targets(info, args, kwargs, out)
        limit = SIM_MEMORY.capture_limit
        if limit is not None and targets and sum(self.storages.values()) > limit:
            SIM_MEMORY.ooms += 1  # what a device allocator counts before torch invalidates the capture
            self.fail(CaptureError(_INVALIDATED))
        self._note_uses(args, kwargs, (t for _, _, t in targets))
        if info.allocation:
            self.keepalive.extend(t for _, _, t in targets)
            return
        if not targets and not info.writes and info.builtin:
            return  # views (the captured view keeps aliasing its input) or metadata: nothing to redo
        self.steps.append(
            (True, op_step(func, args, kwargs, targets, info.single, info.collective), str(func))
        )

    def _fresh_targets(
        self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> list[Target]:
        """The newly allocated tensors ``out`` holds, as (return index, list index, tensor).

        The storage decides, not the schema alone: ``reshape``, ``contiguous`` and ``to`` are annotated
        as aliases but copy when they must (they reach the mode whole where autograd is off), and
        ``_unsafe_view`` is annotated as new but is a view.
        """
        if not any(info.readable):
            return []
        values = (out,) if info.single else out
        inputs: set[int] | None = None
        targets: list[Target] = []
        for i, readable in enumerate(info.readable):
            value = values[i]
            if not readable or value is None:
                continue
            if isinstance(value, torch.Tensor):
                items: list[tuple[int | None, Any]] = [(None, value)]
            elif isinstance(value, (list, tuple)):
                items = list(enumerate(value))
            else:
                continue  # not a tensor: a c10d collective's Work handle, say
            for j, tensor in items:
                if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                    continue
                ptr, nbytes = storage_of(tensor)
                if inputs is None:
                    inputs = input_storages(args, kwargs)
                if ptr in inputs:
                    continue  # a view of an input: it sees every replayed write to that input
                if ptr:
                    self.storages[ptr] = nbytes
                targets.append((i, j, tensor))
        return targets

    def _note_uses(self, args: tuple[Any, ...], kwargs: dict[str, Any], results: Any) -> None:
        """Stretch the lifetime of every allocated storage this op reads or makes to this op."""
        now = self.ops_seen
        self.ops_seen += 1
        lifetimes, allocated = self.lifetimes, self.storages
        for tensor in results:
            ptr = storage_of(tensor)[0]
            if ptr in allocated and ptr not in lifetimes:
                lifetimes[ptr] = (now, now)
        for ptr in input_storages(args, kwargs):
            if ptr in allocated:
                lifetimes[ptr] = (lifetimes.get(ptr, (now, now))[0], now)

    def on_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            host_read = HOST_READ_CALLS.get(func)
        except TypeError:  # an unhashable callable cannot be one of them
            host_read = None
        if host_read is not None:
            self.fail(host_read_error(*host_read))
        previous, self.api = self.api, func
        try:
            return func(*args, **kwargs)
        except CaptureError:
            if self.error is not None:
                # The recorder raised inside this call and torch has pushed it back since; it can leave now.
                sweep_retired()
            raise
        finally:
            self.api = previous

    def run_opaque(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``fn`` unrecorded and record the call itself as one step (its writes are not tracked)."""
        with self._suspended():
            result = fn(*args, **kwargs)
        inputs = input_storages(args, kwargs)
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                ptr, nbytes = storage_of(tensor)
                if ptr and ptr not in inputs:
                    self.storages[ptr] = nbytes
        self._note_uses(args, kwargs, (t for t in tree_leaves(result) if isinstance(t, torch.Tensor)))
        name = getattr(fn, "__qualname__", None) or repr(fn)
        self.steps.append((False, opaque_step(fn, args, kwargs, result), f"opaque:{name}"))
        return result

    @contextlib.contextmanager
    def _suspended(self) -> Iterator[None]:
        """Stop recording; also leave the mode stacks when on top, so compiled code runs as compiled
        (dynamo runs frames eagerly while a dispatch mode is on the stack)."""
        self.paused = True
        on_top = top_mode(True) is self.recorder and top_mode(False) is self.guard
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

    def program(self) -> tuple[Segment, ...]:
        """Group the recorded steps into runs of one kind (kernel ops / opaque calls) for replay."""
        segments: list[Segment] = []
        for kernel, group in itertools.groupby(self.steps, key=lambda entry: entry[0]):
            entries = list(group)
            segments.append((kernel, tuple(e[1] for e in entries), tuple(e[2] for e in entries)))
        return tuple(segments)


def settle_failed() -> Capture | None:
    """Finish this thread's capture if a capture rule ended it; return it (for its error) or ``None``."""
    sweep_retired()
    capture = capture_state.capture
    if capture is None or capture.error is None:
        return None
    capture_state.capture = None
    return capture
