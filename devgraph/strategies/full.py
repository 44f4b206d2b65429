"""``full``: one device graph per key, the whole forward inside it; optionally compiled first.

With a compiler set, each key is captured twice, compiled and plain, and the faster graph is kept
(:mod:`devgraph.strategies.choice`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.context import capturing
from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import GraphKey
from devgraph.contract.modes import Compiler, Strategy
from devgraph.contract.platform import Availability, DeviceGraph, GraphPlatform
from devgraph.errors import BackendUnavailableError
from devgraph.strategies.choice import (
    CompileChoice,
    Kept,
    PlainOrCompiled,
    ReplayTimer,
    agreed_times,
    time_pair,
)
from devgraph.strategies.compiling import CompilingStrategy, dynamo_availability, inductor_compile

__all__ = ["FullEntry", "FullGraphBackend"]

logger = logging.getLogger(__name__)


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


class FullGraphBackend(CompilingStrategy):
    """Captures the entire forward, break ops included, as one graph per key.

    The fastest replay (one launch per step); every op in the forward, break ops too, must be capturable.
    The usual choice for decode. With ``compiler="inductor"`` the forward is compiled once (dynamic
    leading dimension; inductor fuses the elementwise kernels), each key captures the compiled code and the
    plain forward, and keeps the faster graph (``keep_compiled`` in the options keeps the compiled one);
    ``compiler="eager"`` traces with dynamo but runs the traced graph as is (for debugging).
    """

    name = Strategy.FULL.value
    accepts_compiler = True
    runs_breaks_eagerly = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choice = CompileChoice(
            "full", keep_compiled=bool(self.options.extra.get("keep_compiled", False))
        )
        #: Compile the model's repeated block once instead of the whole forward (:mod:`.regions`).
        self.regions = bool(self.options.extra.get("regions", False))
        #: How the two graphs of a key are timed (``None``: the platform's timer); a test sets a stand-in.
        self.replay_timer: ReplayTimer | None = None
        self._forwards: PlainOrCompiled | None = None

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
        compiled = self.compile.wrap(forward, self._dynamo_backend, regions=self.regions)
        forwards = self._forwards
        if forwards is None or forwards.plain_forward is not forward or forwards.compiled is not compiled:
            forwards = self._forwards = PlainOrCompiled(forward, compiled)
        return forwards

    def prepare(self, inputs: Mapping[str, StaticInput], keys: Sequence[GraphKey] = ()) -> None:
        super().prepare(inputs, keys)
        forwards, earlier = self._forwards, self.compile.earlier_choices
        if forwards is None or not keys or not earlier:
            return
        if all(self.choice.earlier_kept(k, earlier) is Kept.PLAIN for k in keys):
            # The process that wrote cache_dir kept the plain graph of every key: the warm-ups run the plain
            # forward too, so nothing is compiled at all.
            forwards.use_plain = True

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.compiler == Compiler.EAGER.value:
            return gm
        return inductor_compile(gm, example_inputs, self.options.inductor_mode)

    # -- capture ------------------------------------------------------------------------------------
    def _capture(self, key: GraphKey, forward_fn: Callable[[], Any]) -> FullEntry:
        forwards = self._forwards
        if self.compiler is None or forwards is None:
            return self._capture_graph(forward_fn, opaque=False)
        earlier = self.choice.cached(key, self.compile.earlier_choices)
        if earlier is not None:
            # A warm start replays what the cold one chose: the same bits (a timing near 1.0x could choose
            # the other graph in this process), and one capture per key instead of two.
            if earlier.kept is Kept.PLAIN:
                with forwards.plain():
                    entry = self._capture_graph(forward_fn, opaque=False)
            else:
                entry = self._capture_graph(forward_fn, opaque=True)
            forwards.kept(forwards.last_signature, earlier.kept)
            return entry
        if not self.choice.trying:
            with forwards.plain():
                entry = self._capture_graph(forward_fn, opaque=False)
            self.choice.record(key, Kept.PLAIN, "abandoned")
            forwards.kept(forwards.last_signature, Kept.PLAIN)
            return entry
        compiled = self._capture_graph(forward_fn, opaque=True)
        timer = self.replay_timer or (self.platform.time_replays if self.platform.times_replays else None)
        if timer is None:
            self.choice.record(key, Kept.COMPILED, "not_timed")
            return compiled
        start = time.perf_counter()
        self.platform.note_outputs(self._pool, compiled.outputs)  # alive while the plain graph is captured
        try:
            with forwards.plain():
                forward_fn()  # the plain forward's own warm-up (its lazy handles), outside any capture
                plain = self._capture_graph(forward_fn, opaque=False)
        except Exception as exc:  # noqa: BLE001 - the compiled graph captured: it serves the key
            logger.warning(
                "devgraph: full: the plain forward of %s could not be captured for the comparison (%s); "
                "keeping the compiled graph",
                key,
                exc,
            )
            self.choice.record(key, Kept.COMPILED, "plain_failed", time.perf_counter() - start)
            return compiled
        group = self._process_group()
        compiled_s, plain_s = time_pair(
            timer, compiled.graph.replay, plain.graph.replay, fixed=group is not None
        )
        compiled_s, plain_s = agreed_times(group, compiled_s, plain_s)
        choice = self.choice.decide(key, compiled_s, plain_s, time.perf_counter() - start)
        kept, dropped = (compiled, plain) if choice.kept is Kept.COMPILED else (plain, compiled)
        dropped.reset()
        forwards.kept(forwards.last_signature, choice.kept)  # verify() runs what this key's graph runs
        if not self.choice.trying:
            forwards.use_plain = True  # the smaller keys' warm-ups run (and compile) nothing compiled
        return kept

    def _process_group(self) -> Any:
        """The owning runner's process group (its ranks must choose alike), or ``None``."""
        owner = self._owner() if self._owner is not None else None
        return getattr(getattr(owner, "plan", None), "process_group", None)

    def _capture_graph(self, forward_fn: Callable[[], Any], *, opaque: bool) -> FullEntry:
        platform = self.platform
        graph = platform.new_graph()
        platform.capture_begin(graph, self._pool)
        try:
            with capturing():
                # A compiled forward is captured whole, dynamo's own wrappers (input-mutation copies)
                # included. dynamo cannot start a frame under the CPU simulator's dispatch mode, so there
                # the call is recorded as one opaque step (on a device this just calls it).
                outputs = platform.record_opaque(forward_fn) if opaque else forward_fn()
        except BaseException:
            platform.abort_capture(graph)
            raise
        platform.capture_end(graph)
        return FullEntry(graph, outputs)

    def release(self, key: GraphKey) -> None:
        super().release(key)
        self.choice.forget(key)

    def cleanup(self) -> None:
        super().cleanup()
        self.choice.reset()
        if self._forwards is not None:
            self._forwards.forget()

    def choices_to_keep(self) -> dict[str, dict[str, Any]]:
        return self.choice.to_keep()

    def capture_notes(self) -> list[str]:
        return [*super().capture_notes(), *self.choice.notes()]

    def describe_key(self, key: GraphKey) -> dict[str, Any]:
        out = super().describe_key(key)
        choice = self.choice.choices.get(key)
        if out and choice is not None:
            out["compiled_or_plain"] = choice.describe()
        return out

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.compiler is not None:
            out["compiled_or_plain"] = self.choice.describe()
        return out

    def stats(self) -> dict[str, Any]:
        if self.compiler is None:
            return {}
        return {"compiled_or_plain": self.choice.summary()}
