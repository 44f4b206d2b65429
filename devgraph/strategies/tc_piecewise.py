"""``tc_piecewise``: ``torch.compile`` the forward, split it at break ops, capture each piece per size.

The devgraph dynamo backend splits the FX graph at every break op, compiles each piece once with
dynamic shapes (``eager`` or ``inductor``) and wraps it. During ``capture_one`` every piece captures
itself as one graph segment into the shared pool and every break op is recorded, giving the same
:class:`SegmentedPlan` as ``breakable``: replay never enters dynamo, so per-step CPU cost matches
``breakable`` while the GPU runs the compiled (fused) kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from devgraph.contract.breaks import is_break_target
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import Compiler, Strategy
from devgraph.contract.platform import Availability, GraphPlatform
from devgraph.strategies.breakable import SegmentRecorder
from devgraph.strategies.compiling import CompilingStrategy, dynamo_availability, inductor_compile
from devgraph.strategies.segments import SegmentedPlan

__all__ = ["TcPiecewiseBackend"]

logger = logging.getLogger(__name__)


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
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)  # type: ignore[arg-type]
    pieces: list[str] = []
    breaks: list[str] = []
    for name, sub in split.named_children():
        graph = cast(torch.fx.GraphModule, sub).graph
        has_break = any(n.op == "call_function" and is_break_target(n.target) for n in graph.nodes)
        (breaks if has_break else pieces).append(name)
    return split, pieces, breaks


def _piece_example_inputs(
    gm: torch.fx.GraphModule, split: torch.fx.GraphModule, pieces: list[str]
) -> dict[str, list[Any]]:
    """Run ``split`` on dynamo's fake (symbolic) inputs to learn each piece's example inputs."""
    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next(x.fake_mode for x in fakes if isinstance(x, torch.Tensor))  # type: ignore[attr-defined]
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

    def __init__(self, owner: TcPiecewiseBackend, fn: Callable[..., Any], opaque: bool) -> None:
        super().__init__()
        self.owner = owner
        self.fn = fn
        # Inductor's generated code is invisible to the CPU simulator's dispatch mode, so it is recorded as
        # one call; an eager piece is an FX graph of torch ops, captured op by op (so the simulator sees a
        # host sync inside it, as a device would).
        self.opaque = opaque

    def forward(self, *args: Any) -> Any:
        recorder = self.owner._recorder
        if recorder is None:
            return self.fn(*args)
        recorder.begin_segment()
        outputs = self.owner.platform.record_opaque(self.fn, *args) if self.opaque else self.fn(*args)
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


class TcPiecewiseBackend(CompilingStrategy):
    """``torch.compile`` + piecewise graphs split at break ops.

    Options: ``compiler`` = ``eager`` (no code generation; fast to compile; the default) or ``inductor``
    (fused kernels, ``inductor_mode`` passed through). The forward is compiled once for every size; a
    recompile after capture is reported (logged and counted, or raised as :class:`RecompileError` with
    ``on_recompile="raise"``).
    """

    name = Strategy.TC_PIECEWISE.value
    accepts_compiler = True
    runs_breaks_eagerly = True
    default_compiler = Compiler.EAGER.value

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_pieces = 0
        self.num_breaks = 0
        self._recorder: SegmentRecorder | None = None

    @classmethod
    def availability(cls, platform: GraphPlatform) -> Availability:
        return dynamo_availability(platform)

    # -- compilation --------------------------------------------------------------------------------
    def wrap_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        return self.compile.wrap(forward, self._dynamo_backend)

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inductor = self.compiler == Compiler.INDUCTOR.value
        split, pieces, breaks = _split_at_breaks(gm)
        examples = _piece_example_inputs(gm, split, pieces) if inductor else {}
        for name in pieces:
            module = getattr(split, name)
            example = examples.get(name)
            if inductor and example is not None:
                setattr(
                    split,
                    name,
                    _Piece(self, inductor_compile(module, example, self.options.inductor_mode), True),
                )
            else:
                setattr(split, name, _Piece(self, module, False))
        for name in breaks:
            setattr(split, name, _BreakPiece(self, getattr(split, name)))
        self.num_pieces, self.num_breaks = len(pieces), len(breaks)
        logger.info(
            "tc_piecewise: compiled %d pieces around %d break ops with %s",
            len(pieces),
            len(breaks),
            self.compiler,
        )
        return split

    # -- capture ------------------------------------------------------------------------------------
    def _capture(self, key: GraphKey, forward_fn: Callable[[], Any]) -> SegmentedPlan:
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

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "pieces": self.num_pieces, "break_ops": self.num_breaks}
