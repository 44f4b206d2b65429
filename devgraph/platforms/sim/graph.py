"""Simulated device graphs on the CPU: record every aten op at capture, re-run them at replay.

A :class:`SimGraph` behaves like a CUDA graph so that every graph strategy can be tested without a GPU:

* Capture records each aten op dispatched on the capturing thread (through
  :class:`~devgraph.platforms.sim.dispatch_modes.SimRecorder`, a ``TorchDispatchMode``) with strong
  references to its arguments and results. The op also runs, so that the Python code around it sees real
  values.
* Capture leaves no side effects on memory that existed before it, as a device capture (which records
  kernels without running them) leaves none: every storage that existed before ``capture_begin`` and
  that a recorded op writes (in-place ops, ``out=`` variants, ``copy_``, ``index_put_``, the mutated
  arguments of a custom op) is copied just before the first such write and copied back when the
  capture ends, by ``capture_end``, by ``abort_capture`` / ``reset``, or by a capture rule that failed
  it. A KV cache, a step counter, the runner's static inputs and the weights are therefore unchanged by
  a capture; the writes happen at every replay, as on a device. Storages the capture allocated are the
  graph's own and keep the values computed into them. Whole untyped storages are copied, so a write
  through a view restores the entire base tensor's memory.
* Replay re-runs the recorded ops **on the same tensors**. Results of ops that allocate are copied back
  into the tensors captured first, so outputs keep their identity and ``data_ptr``; view ops are not
  re-run (the captured view still aliases the same storage); ops that write are re-run as they are. A
  caller who writes into a captured input sees the new value flow through; one who rebinds a name to a
  new tensor gets stale results, exactly as on a device.
* A custom op with a Python body (``torch.library.custom_op``, so every ``graph_break`` op) is captured
  the way a device captures it: its body runs once and the aten ops it issues are recorded (and their
  writes undone at the end, like any other), so Python state it read at capture (the forward context,
  a host scalar) is baked into the graph. A custom op with a C++ kernel is recorded, and re-run, as one
  op; of its writes only those its schema declares are undone.
* Capture enforces the device rules (:mod:`devgraph.platforms.sim.device_rules`): an op that syncs with
  the host (``.item()``, ``.tolist()``, ``bool(t)``, ``torch.equal``) or whose output shape depends on
  tensor data (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing) raises
  :class:`~devgraph.errors.CaptureError`, as does a capture nested in another.

Limits of the undo: calls recorded whole through :func:`record_opaque` (compiled code the simulator
cannot see op by op) and graphs replayed inside another capture run for real and are not tracked, so
their writes to older memory stay after the capture; so do writes made by code with no aten op (through
``.numpy()``, which a capture rejects anyway) or on another thread. A tensor created during the capture
without an aten op (``torch.from_numpy``) counts as older memory. A ``resize_`` of an older tensor
restores its bytes but not its new shape. The copies cost, for the length of a capture, the memory of
each older storage the capture writes.

The parts: :mod:`~devgraph.platforms.sim.capture` (the capture in progress),
:mod:`~devgraph.platforms.sim.dispatch_modes` (the dispatch modes and the per-thread mode stacks),
:mod:`~devgraph.platforms.sim.ops` (op facts), :mod:`~devgraph.platforms.sim.snapshots` (the undo),
:mod:`~devgraph.platforms.sim.steps` (replay steps) and :mod:`~devgraph.platforms.sim.device_memory` (memory
accounting).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from devgraph.errors import CaptureError, ReplayError
from devgraph.platforms.sim.capture import Capture, capture_state, settle_failed
from devgraph.platforms.sim.device_memory import SimPool, reserved_bytes
from devgraph.platforms.sim.dispatch_modes import SimRecorder, mode_state
from devgraph.platforms.sim.steps import Segment, Step

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


# -- the graph ---------------------------------------------------------------------------------------
class SimGraph:
    """A captured sequence of ops that replays on the same tensors: the CPU stand-in for a CUDA graph.

    Capture with :meth:`CpuSimPlatform.capture_begin` / ``capture_end`` (or the methods here), then
    :meth:`replay` as often as needed; :meth:`reset` drops everything the graph holds.
    """

    def __init__(self) -> None:
        self._program: tuple[Segment, ...] | None = None
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

    def _finish_capture(self, capture: Capture) -> None:
        self._capturing_thread = None
        self._program = capture.program()
        self._kernel_keys = capture.kernel_keys
        self._keepalive = tuple(capture.keepalive)
        self._pool = capture.pool
        storages = dict(capture.storages)
        self._nbytes = sum(storages.values())
        capture.pool._hold(storages, {p: capture.lifetimes[p] for p in storages if p in capture.lifetimes})
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
        capture = capture_state.capture
        if capture is not None and capture.error is None and not capture.paused and not mode_state.in_op:
            # Replayed while another graph captures: record it there as one step (a child graph).
            capture.run_opaque(self._run, (program,), {})
            return
        self._run(program)

    def _run(self, program: tuple[Segment, ...]) -> None:
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
    def _step_name(program: tuple[Segment, ...], step: Step | None) -> str:
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

        A capture still in progress into this graph on this thread is abandoned first (its writes to
        memory that existed before it are undone, as at capture end).
        """
        settle_failed()
        capture = capture_state.capture
        if capture is not None and capture.graph is self:
            capture_state.capture = None
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
    settle_failed()
    current = capture_state.capture
    if current is not None:
        raise CaptureError(
            f"nested capture: this thread is already capturing into {current.graph!r}; device graphs "
            f"cannot be captured inside one another, so call capture_end() on it before capturing {graph!r}"
        )
    graph._start_capture()
    capture = Capture(graph, pool if pool is not None else SimPool(), graph._capture_failed)
    try:
        capture.enter()
    except BaseException:
        graph._capturing_thread = None
        raise
    capture_state.capture = capture


def end_capture(graph: SimGraph) -> None:
    """Stop recording into ``graph`` and finalize it for replay.

    Raises :class:`CaptureError` if ``graph`` is not capturing on this thread, including when a capture
    rule already ended its capture (the error then repeats the original one).
    """
    failed = settle_failed()
    if failed is not None and failed.graph is graph and failed.error is not None:
        raise CaptureError(
            f"the capture into {graph!r} was already ended by an error: {failed.error}", op=failed.error.op
        ) from failed.error
    capture = capture_state.capture
    if capture is None or capture.graph is not graph:
        raise CaptureError(f"capture_end() on {graph!r}, which is not capturing on this thread")
    capture_state.capture = None
    capture.close()
    graph._finish_capture(capture)


def abort_capture(graph: SimGraph) -> None:
    """End a capture into ``graph`` that failed half-way (if any) and reset the graph; never raises
    for a graph that is not capturing."""
    graph.reset()


def is_capturing() -> bool:
    """Whether this thread is capturing into a sim graph now."""
    capture = capture_state.capture
    return capture is not None and capture.error is None


def record_opaque(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)``; while this thread captures, record the call as one replay step.

    The recorder is off while ``fn`` runs (it may run compiled code no dispatch mode sees); replay calls
    ``fn`` again with the same arguments and copies its tensor results into the captured ones. Unlike
    recorded ops, what ``fn`` writes into memory that existed before the capture is not undone when the
    capture ends: the simulator cannot see those writes.
    """
    settle_failed()
    capture = capture_state.capture
    if capture is None or capture.paused or mode_state.in_op:
        # Not capturing, nested in another opaque call, or inside an op recorded as a whole.
        return fn(*args, **kwargs)
    return capture.run_opaque(fn, args, kwargs)
