"""``full``: one device graph per key, the whole forward inside it; optionally compiled first."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.context import capture_flag
from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import Compiler, Strategy
from devgraph.contract.platform import Availability, DeviceGraph, GraphPlatform
from devgraph.errors import BackendUnavailableError
from devgraph.strategies._base import GraphStrategy
from devgraph.strategies.compiling import (
    CompileSession,
    check_compiler,
    dynamo_availability,
    inductor_compile,
)

__all__ = ["FullEntry", "FullGraphBackend"]


@dataclass
class FullEntry:
    """What ``full`` keeps per key: the graph and the outputs its capture returned."""

    graph: DeviceGraph
    outputs: Any

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs

    def reset(self) -> None:
        self.graph.reset()
        self.outputs = None

    def describe(self) -> dict[str, Any]:
        return {"graphs": 1, "segments": 1, "break_ops": 0}


class FullGraphBackend(GraphStrategy):
    """Captures the entire forward, break ops included, as one graph per key.

    The fastest replay (one launch per step); every op in the forward, break ops too, must be capturable.
    The usual choice for decode. With ``compiler="inductor"`` the forward is compiled once (dynamic
    leading dimension; inductor fuses the elementwise kernels) and each key captures the compiled code;
    ``compiler="eager"`` traces with dynamo but runs the traced graph as is (for debugging).
    """

    name = Strategy.FULL.value
    accepts_compiler = True
    runs_breaks_eagerly = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiler = check_compiler(self.options.compiler, "full")
        self.compile = CompileSession("full", self.options, self.platform)

    @classmethod
    def availability(cls, platform: GraphPlatform) -> Availability:
        return platform.availability()

    # -- compilation --------------------------------------------------------------------------------
    def wrap_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        if self.compiler is None:
            return forward
        available = dynamo_availability(self.platform)
        if not available:
            raise BackendUnavailableError(f"full with compiler {self.compiler!r}: {available.reason}")
        return self.compile.wrap(forward, self._dynamo_backend)

    def prepare(self, inputs: Mapping[str, StaticInput], keys: Sequence[GraphKey] = ()) -> None:
        if self.compiler is not None:
            self.compile.prepare(inputs, keys, self.compiler)

    def _dynamo_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compile.tracker.compiled()
        if self.compiler == Compiler.EAGER.value:
            return gm
        return inductor_compile(gm, example_inputs, self.options.inductor_mode)

    # -- capture ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture_session(self, stream: Any, *, shared_pool: bool = True) -> Iterator[None]:
        with super().capture_session(stream, shared_pool=shared_pool):
            yield
        if self.compiler is not None:
            # Save new artifacts; from here on a compile means a guard failed at run time: a bug to report.
            self.compile.captured()

    def _capture(self, key: GraphKey, forward_fn: Callable[[], Any]) -> FullEntry:
        platform = self.platform
        graph = platform.new_graph()
        platform.capture_begin(graph, self._pool)
        try:
            with capture_flag():
                # A compiled forward is captured whole, dynamo's own wrappers (input-mutation copies)
                # included. dynamo cannot start a frame under the CPU simulator's dispatch mode, so there
                # the call is recorded as one opaque step (on a device this just calls it).
                outputs = forward_fn() if self.compiler is None else platform.record_opaque(forward_fn)
        except BaseException:
            platform.abort_capture(graph)
            raise
        platform.capture_end(graph)
        return FullEntry(graph, outputs)

    def cleanup(self) -> None:
        super().cleanup()
        self.compile.reset()

    def capture_notes(self) -> list[str]:
        return self.compile.notes()

    def describe(self) -> dict[str, Any]:
        return {"compiler": self.compiler, **self.compile.describe()}
