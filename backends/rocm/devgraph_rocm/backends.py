"""The ROCm backends: ``full`` (decode default), ``tc_piecewise`` (prefill/encode default) and a refused
``breakable``.

Warm-up on the capture stream: hipBLASLt creates its handle and workspace lazily, the first time a
GEMM runs on a stream. If the first GEMM on the capture stream happens inside the capture, that
allocation is a non-capturable HIP call and capture fails (or, worse, records a workspace that is
freed later). :class:`~devgraph.runner.graph_runner.GraphRunner` runs every warm-up iteration inside the
backend's ``capture_session(stream)``, i.e. on the capture stream, so the handles exist before capture begins;
these backends additionally refuse to capture on any other stream than the session's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph import Availability, BackendUnavailableError, CaptureError, GraphKey, GraphPlatform
from devgraph.strategies import BreakableBackend, FullGraphBackend, TcPiecewiseBackend

__all__ = ["RocmFullGraphBackend", "RocmTcPiecewiseBackend", "RocmBreakableBackend", "BREAKABLE_REFUSED"]

BREAKABLE_REFUSED = (
    "breakable is refused on ROCm: ending and beginning a HIP graph capture at every break op (dozens per "
    "step) is not validated on HIP graphs and hipBLASLt's per-stream handles make each new segment a capture "
    "hazard; use tc_piecewise, which gives the same piecewise replay (configs asking for breakable on ROCm "
    "are downgraded by the rule rocm-no-breakable)"
)


class _CaptureStreamGuard:
    """Capture only on the session's stream, the one the runner warmed up on (hipBLASLt, see module doc)."""

    platform: GraphPlatform
    _stream: Any

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        current = self.platform.current_stream()
        if self._stream is not None and current != self._stream:
            raise CaptureError(
                f"{key}: capture must run on the capture stream of capture_session() "
                f"({self._stream}), where the warm-up ran, not on {current}: hipBLASLt creates handles "
                "lazily per stream, and creating one during capture fails",
                size=key.tokens,
            )
        return super().capture_one(key, forward_fn)  # type: ignore[misc]


class RocmFullGraphBackend(_CaptureStreamGuard, FullGraphBackend):
    """One HIP graph per batch size (the decode default)."""


class RocmTcPiecewiseBackend(_CaptureStreamGuard, TcPiecewiseBackend):
    """torch.compile pieces, each captured as a HIP graph per size (the prefill and encode default)."""


class RocmBreakableBackend(BreakableBackend):
    """Registered so ``devgraph info`` says why it is refused; it never runs."""

    @classmethod
    def availability(cls, platform: GraphPlatform) -> Availability:
        return Availability(False, BREAKABLE_REFUSED)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise BackendUnavailableError(BREAKABLE_REFUSED)
