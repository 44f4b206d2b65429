"""``tc_piecewise``: ``torch.compile`` the forward, split it at break ops, capture each piece per size.

The devgraph dynamo backend splits the FX graph at every break op, compiles each piece once with
dynamic shapes (``eager`` or ``inductor``) and wraps it. During ``capture_one`` every piece captures
itself as one graph segment into the shared pool and every break op is recorded, giving the same
:class:`SegmentedPlan` as ``breakable``: replay never enters dynamo, so per-step CPU cost matches
``breakable`` while the GPU runs the compiled (fused) kernels.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from devgraph.breaks import is_break_target
from devgraph.errors import CaptureError, ConfigError, RecompileError
from devgraph.platform import Availability, GraphPlatform
from devgraph.strategies._base import GraphStrategy
from devgraph.strategies.breakable import SegmentRecorder
from devgraph.strategies.plan import SegmentedPlan

__all__ = ["TcPiecewiseBackend", "COMPILERS"]

logger = logging.getLogger(__name__)

COMPILERS = ("eager", "inductor")


def _split_at_breaks(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """Split ``gm`` so every break op sits alone in its own submodule; returns (split, pieces, breaks)."""
    from torch.fx.passes.split_module import split_module

    partition: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_break_target(node.target):
            current += 1
            partition[node] = current
            current += 1
        else:
            partition[node] = current
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    pieces: list[str] = []
    breaks: list[str] = []
    for name, sub in split.named_children():
        has_break = any(n.op == "call_function" and is_break_target(n.target) for n in sub.graph.nodes)
        (breaks if has_break else pieces).append(name)
    return split, pieces, breaks


def _piece_example_inputs(
    gm: torch.fx.GraphModule, split: torch.fx.GraphModule, pieces: list[str]
) -> dict[str, list[Any]]:
    """Run ``split`` on dynamo's fake (symbolic) inputs to learn each piece's example inputs."""
    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next(x.fake_mode for x in fakes if isinstance(x, torch.Tensor))
    wanted = set(pieces)
    seen: dict[str, list[Any]] = {}

    class _Collect(torch.fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            if target in wanted:
                seen[target] = list(args)
            return super().call_module(target, args, kwargs)

    with fake_mode:
        _Collect(split).run(*fakes)
    return seen


class _Piece(torch.nn.Module):
    """A compiled piece; captures itself as one segment while its backend is building a plan."""

    def __init__(self, owner: TcPiecewiseBackend, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.owner = owner
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        recorder = self.owner._recorder
        if recorder is None:
            return self.fn(*args)
        recorder.begin_segment()
        outputs = self.owner.platform.record_opaque(self.fn, *args)
        recorder.end_segment()
        return outputs


class _BreakPiece(torch.nn.Module):
    """A submodule holding one break op; recorded as a break call while a plan is being built."""

    def __init__(self, owner: TcPiecewiseBackend, module: torch.fx.GraphModule) -> None:
        super().__init__()
        self.owner = owner
        self.module = module

    def forward(self, *args: Any) -> Any:
        recorder = self.owner._recorder
        if recorder is None:
            return self.module(*args)
        return recorder.run_break(self.module, args, {})


class TcPiecewiseBackend(GraphStrategy):
    """``torch.compile`` + piecewise graphs split at break ops.

    Options: ``compiler`` = ``eager`` (no code generation; fast to compile) or ``inductor`` (fused kernels).
    A recompile after capture is reported (logged, counted in ``recompiles``; raised as
    :class:`RecompileError` when the option ``on_recompile="raise"`` is set).
    """

    name = "tc_piecewise"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiler = self.options.compiler or "eager"
        if self.compiler not in COMPILERS:
            raise ConfigError(
                f"tc_piecewise compiler {self.compiler!r} is unknown; accepted: {', '.join(COMPILERS)}"
            )
        self.on_recompile = str(self.options.extra.get("on_recompile", "warn"))
        self.compiles = 0
        self.recompiles = 0
        self.num_pieces = 0
        self._sealed = False
        self._recorder: SegmentRecorder | None = None
        self._compiled: Callable[..., Any] | None = None

    @classmethod
    def availability(cls, platform: GraphPlatform) -> Availability:
        base = platform.availability()
        if not base:
            return base
        try:
            import torch._dynamo  # noqa: F401
        except Exception as exc:  # e.g. a Python version this torch's dynamo does not support
            return Availability(
                False, f"torch.compile is unavailable here ({exc}); use 'full' or 'breakable'"
            )
        return Availability(True)

    # -- compilation -----------------------------------------------------------------------------
    def wrap_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        if self._compiled is None:
            compiled = torch.compile(forward, backend=self._dynamo_backend, dynamic=True, fullgraph=True)

            def call(*args: Any, **kwargs: Any) -> Any:
                try:
                    return compiled(*args, **kwargs)
                except torch._dynamo.exc.Unsupported as exc:
                    first_line = str(exc).strip().splitlines()[0]
                    raise CaptureError(
                        f"torch.compile cannot trace the forward as one graph ({first_line}); "
                        "tc_piecewise needs "
                        "a forward without dynamo graph breaks: move the offending code into a "
                        "@devgraph.graph_break op, or use the 'breakable' mode"
                    ) from exc
                except torch._dynamo.exc.BackendCompilerFailed as exc:
                    # Dynamo wraps whatever our backend raises; hand devgraph's own error back unwrapped.
                    inner = getattr(exc, "inner_exception", None)
                    if isinstance(inner, RecompileError):
                        raise inner from None
                    raise

            self._compiled = call
        return self._compiled

    def _dynamo_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        if self._sealed:
            self._report_recompile(gm)
        split, pieces, breaks = _split_at_breaks(gm)
        examples = _piece_example_inputs(gm, split, pieces) if self.compiler == "inductor" else {}
        for name in pieces:
            module = getattr(split, name)
            fn = self._compile_piece(module, examples.get(name))
            setattr(split, name, _Piece(self, fn))
        for name in breaks:
            setattr(split, name, _BreakPiece(self, getattr(split, name)))
        self.num_pieces = len(pieces)
        logger.info(
            "tc_piecewise: compiled %d pieces around %d break ops with %s",
            len(pieces),
            len(breaks),
            self.compiler,
        )
        return split

    def _compile_piece(self, module: torch.fx.GraphModule, example: list[Any] | None) -> Callable[..., Any]:
        if self.compiler == "eager" or example is None:
            return module
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(module, example)

    def _report_recompile(self, gm: torch.fx.GraphModule) -> None:
        self.recompiles += 1
        message = (
            f"tc_piecewise recompiled after capture (recompile #{self.recompiles}): the captured graphs are "
            "bypassed for the shapes that triggered it. Usually an input changed dtype, device or rank, "
            "or a Python value the forward branches on changed; run with TORCH_LOGS=recompiles to see the "
            "failing guard, and keep inputs in the runner's static buffers"
        )
        if self.on_recompile == "raise":
            raise RecompileError(message)
        logger.warning(message)

    # -- capture ---------------------------------------------------------------------------------
    def _capture(self, key: int, forward_fn: Callable[[], Any]) -> SegmentedPlan:
        recorder = SegmentRecorder(self.platform, self._pool)
        self._recorder = recorder
        try:
            outputs = forward_fn()
        except BaseException:
            recorder.abort()
            raise
        finally:
            self._recorder = None
        return recorder.finish(outputs)

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        with super().capture_session(stream):
            yield
        # From here on a compile means a guard failed at run time: the bug this backend must report.
        self._sealed = True

    def cleanup(self) -> None:
        super().cleanup()
        self._sealed = False
