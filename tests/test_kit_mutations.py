"""The conformance kit's mutation suite: deliberately broken backends, each with one bug, each caught.

Every mutant subclasses a correct CPU strategy and breaks one clause of the backend contract the way a
careless or hurried vendor backend might. The kit must report the check that describes the bug as
``failed`` (not ``error``, not ``skipped``), with a message that names the bug. The control group, the
unmutated built-in strategies, must pass every check on the CPU with no skips: a kit that fails
everything would otherwise "catch" every mutant.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from devgraph.contract.context import capturing, forward_context, get_forward_context
from devgraph.contract.keys import Batch, GraphKey
from devgraph.registry.plugins import Registry
from devgraph.strategies import BreakableBackend, FullGraphBackend, TcPiecewiseBackend
from devgraph.strategies.segments import BreakCall
from devgraph.testing import check_names, run_check, run_conformance

DOCS = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"


# -- the mutants -------------------------------------------------------------------------------------
class ReplaysLargest(FullGraphBackend):
    """Replays the largest graph for every key (one graph for all sizes: rows past the bucket re-run)."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        return super().replay(max(self._entries, key=GraphKey.sort_key), static_inputs)


class BreakableReplaysLargest(BreakableBackend):
    """The same bug under ``breakable``: segment plans of the largest key replay for every key."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        return super().replay(max(self._entries, key=GraphKey.sort_key), static_inputs)


class CapturesWithLargestViews(FullGraphBackend):
    """Captures every key with the forward bound to the first (largest) key's views."""

    _first: Callable[[], Any] | None = None

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        if self._first is None:
            self._first = forward_fn
        return super().capture_one(key, self._first)


class SwallowsCaptureError(FullGraphBackend):
    """Catches a failed capture and returns eager outputs, so capture() "succeeds"."""

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        try:
            return super().capture_one(key, forward_fn)
        except Exception:
            return forward_fn()


class ReplaysTwice(FullGraphBackend):
    """Replays the graph twice per step (harmless for idempotent forwards only)."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        super().replay(key, static_inputs)
        return super().replay(key, static_inputs)


class TcReplaysTwice(TcPiecewiseBackend):
    """The same bug under ``tc_piecewise``."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        super().replay(key, static_inputs)
        return super().replay(key, static_inputs)


class _KeepsForwards(FullGraphBackend):
    """Keeps each key's forward from capture, for the mutants below that call it again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forwards: dict[GraphKey, Callable[[], Any]] = {}

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        outputs = super().capture_one(key, forward_fn)
        self._forwards[key] = forward_fn
        return outputs


class ReplaysAndRunsEagerly(_KeepsForwards):
    """Replays, then also runs the forward eagerly "to be safe"; returns the graph's outputs."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        outputs = super().replay(key, static_inputs)
        with torch.no_grad():
            self._forwards[key]()
        return outputs


class HasShapeAlwaysTrue(FullGraphBackend):
    """Claims a graph for every key."""

    def has_shape(self, key: GraphKey) -> bool:
        return True


class HasShapeTokensOnly(FullGraphBackend):
    """Matches keys on the token count alone, ignoring the other axes."""

    def has_shape(self, key: GraphKey) -> bool:
        return any(k.tokens == key.tokens for k in self._entries)


class NeverReplays(FullGraphBackend):
    """Captures, then never admits to holding a graph (every step silently runs eagerly)."""

    def has_shape(self, key: GraphKey) -> bool:
        return False


class ClonedOutputs(FullGraphBackend):
    """Replays correctly but returns fresh copies (new addresses every replay)."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        outputs = super().replay(key, static_inputs)
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)


class PythonReplay(_KeepsForwards):
    """Re-runs the forward at replay instead of replaying what was captured."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        if key not in self._entries:
            return super().replay(key, static_inputs)
        with torch.no_grad():
            return self._forwards[key]()

    def cleanup(self) -> None:
        super().cleanup()
        self._forwards.clear()


class CleanupLeavesEntries(FullGraphBackend):
    """Resets its graphs on cleanup but forgets to drop the entries: has_shape() still says yes."""

    def cleanup(self) -> None:
        for entry in self._entries.values():
            entry.reset()
        self._shared_pool = None


class ReplayableAfterCleanup(FullGraphBackend):
    """Moves its graphs aside on cleanup (has_shape() false) but still replays them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._retired: dict[GraphKey, Any] = {}

    def cleanup(self) -> None:
        self._retired.update(self._entries)
        self._entries.clear()
        self._shared_pool = None

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        if key in self._retired and key not in self._entries:
            return self._retired[key].replay()
        return super().replay(key, static_inputs)


class ReleaseKeepsGraph(FullGraphBackend):
    """Says it supports release() but keeps the graph."""

    def release(self, key: GraphKey) -> None:
        pass


class _HalfCaptured:
    outputs = None

    def replay(self) -> Any:
        return None

    def reset(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {}


class LeavesHalfCapture(FullGraphBackend):
    """Keeps a half-captured entry for a key whose capture failed."""

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        try:
            return super().capture_one(key, forward_fn)
        except BaseException:
            self._entries[key] = _HalfCaptured()
            raise


class NotMarkedReplaying(BreakableBackend):
    """Does not set is_replaying() around replays."""

    def runtime_session(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class BakesBreakContext(BreakableBackend):
    """Replays break ops inside the forward context seen at capture, not the step's live one."""

    _baked: Any = None

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        self._baked = get_forward_context()
        return super().capture_one(key, forward_fn)

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        with forward_context(self._baked):
            return super().replay(key, static_inputs)


class SkipsBreakOps(BreakableBackend):
    """Replays the graph segments only: break ops keep their capture-time outputs."""

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        plan = self._entries[key]
        for step in plan.steps:  # type: ignore[attr-defined]
            if not isinstance(step, BreakCall):
                step.replay()
        return plan.outputs


class KeysByTokens(FullGraphBackend):
    """Keys its graphs by the token count alone: a later variant's capture replaces an earlier one's."""

    def capture_one(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        tokens_only = GraphKey(key.tokens)
        self.release(tokens_only)
        return super().capture_one(tokens_only, forward_fn)

    def has_shape(self, key: GraphKey) -> bool:
        return super().has_shape(GraphKey(key.tokens))

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        return super().replay(GraphKey(key.tokens), static_inputs)


class NotMarkedCapturing(FullGraphBackend):
    """Captures without telling model code (is_capturing() stays False inside the graph)."""

    def _capture(self, key: GraphKey, forward_fn: Callable[[], Any]) -> Any:
        def unmarked() -> Any:
            with capturing(False):
                return forward_fn()

        return super()._capture(key, unmarked)


class DeclinesPadded(FullGraphBackend):
    """can_run() refuses every padded step, which then silently runs eagerly."""

    def can_run(self, batch: Batch) -> bool:
        return batch.n == batch.size


class ReleaseLeaks(FullGraphBackend):
    """release() forgets the key but keeps its graph and outputs alive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._leaked: list[Any] = []

    def release(self, key: GraphKey) -> None:
        self._leaked.append(self._entries.pop(key, None))


class IgnoresOwnership(FullGraphBackend):
    """Lets any number of runners bind it."""

    def bind(self, owner: object) -> None:
        pass


@dataclass(frozen=True)
class Mutant:
    """A broken backend, the checks that must fail for it, and a fragment each failure must contain."""

    name: str
    cls: type
    expected: Mapping[str, str]


MUTANTS = [
    Mutant("m_replays_largest", ReplaysLargest, {"stale_rows": "re-ran the stale rows"}),
    Mutant("m_breakable_largest", BreakableReplaysLargest, {"stale_rows": "re-ran the stale rows"}),
    Mutant(
        "m_largest_views",
        CapturesWithLargestViews,
        {
            "stale_rows": "output_axes says it follows tokens",
            "static_addresses": "output_axes says it follows",
        },
    ),
    Mutant("m_swallows_error", SwallowsCaptureError, {"capture_errors": "swallowed the CaptureError"}),
    Mutant("m_replays_twice", ReplaysTwice, {"step_once": "advanced by 2"}),
    Mutant("m_tc_replays_twice", TcReplaysTwice, {"step_once": "advanced by 2"}),
    Mutant("m_replay_and_eager", ReplaysAndRunsEagerly, {"step_once": "advanced by 2"}),
    Mutant("m_has_shape_true", HasShapeAlwaysTrue, {"has_shape": "true before capture()"}),
    Mutant("m_has_shape_tokens", HasShapeTokensOnly, {"has_shape": "keys never captured"}),
    Mutant(
        "m_never_replays",
        NeverReplays,
        {"has_shape": "false for captured keys", "static_addresses": "did not replay"},
    ),
    Mutant("m_cloned_outputs", ClonedOutputs, {"static_addresses": "different addresses"}),
    Mutant(
        "m_python_replay",
        PythonReplay,
        {"stale_inputs": "re-runs Python at replay", "static_addresses": "different addresses"},
    ),
    Mutant(
        "m_cleanup_leaves",
        CleanupLeavesEntries,
        {"has_shape": "still true", "cleanup": "still held"},
    ),
    Mutant("m_replayable_after", ReplayableAfterCleanup, {"cleanup": "replayed"}),
    Mutant(
        "m_release_keeps",
        ReleaseKeepsGraph,
        {"cleanup": "after release(", "lazy_capture": "lazily captured step"},
    ),
    Mutant("m_half_capture", LeavesHalfCapture, {"failed_capture": "leave nothing of its key behind"}),
    Mutant(
        "m_not_marked_replaying",
        NotMarkedReplaying,
        {"runtime_session": "False inside runtime_session()", "break_ops": "is_replaying() False"},
    ),
    Mutant("m_baked_context", BakesBreakContext, {"break_ops": "not the live 3.0"}),
    Mutant("m_skips_breaks", SkipsBreakOps, {"break_ops": "did not run at replay"}),
    Mutant("m_ignores_owner", IgnoresOwnership, {"ownership": "accepted a backend"}),
    Mutant("m_keys_by_tokens", KeysByTokens, {"variants": "variant scaled="}),
    Mutant(
        "m_not_marked_capturing", NotMarkedCapturing, {"break_ops": "is_capturing() False while captured"}
    ),
    Mutant("m_declines_padded", DeclinesPadded, {"padding_rows": "made 0 replay() calls"}),
    Mutant("m_release_leaks", ReleaseLeaks, {"lazy_capture": "are still alive"}),
]


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    """A registry of its own: the built-ins plus every mutant (nothing leaks into the global one)."""
    registry = Registry(entry_points=False).load()
    for mutant in MUTANTS:
        registry.add_backend(mutant.cls, name=mutant.name, platform="cpu", origin="tests/test_kit_mutations")
    yield registry


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_kit_catches_mutant(mutant: Mutant, registry: Registry) -> None:
    report = run_conformance(f"cpu:{mutant.name}", checks=list(mutant.expected), registry=registry)
    for check, fragment in mutant.expected.items():
        result = report.result(check)
        assert result.status == "failed", f"{mutant.name} ({mutant.cls.__doc__}): {check} {result}"
        assert fragment in result.detail, f"{mutant.name}: {check} failed for another reason: {result.detail}"
    assert not report.passed


def test_suite_is_large_covers_every_strategy_and_is_documented() -> None:
    assert len(MUTANTS) >= 12 and len({m.name for m in MUTANTS}) == len(MUTANTS)
    bases = {base for m in MUTANTS for base in m.cls.__mro__}
    assert {FullGraphBackend, BreakableBackend, TcPiecewiseBackend} <= bases
    assert {check for m in MUTANTS for check in m.expected} <= set(check_names())
    documented = set(re.findall(r"^\| `(m_\w+)` \|", DOCS.read_text(), flags=re.MULTILINE))
    assert documented == {m.name for m in MUTANTS}


# -- the control group ------------------------------------------------------------------------------
@pytest.mark.parametrize("check", check_names())
@pytest.mark.parametrize("target", ["cpu:full", "cpu:breakable", "cpu:tc_piecewise"])
def test_builtin_backends_pass_every_check(target: str, check: str) -> None:
    result = run_check(target, check)
    assert result.status == "passed", f"{target} {check}: {result.status}: {result.detail}"
