"""Every strategy end to end on the reference model (CPU simulated graphs), plus break-op semantics."""

from __future__ import annotations

import logging

import pytest
import torch

import devgraph
from devgraph import CaptureError, GraphRunner, RecompileError, StaticInput, graph_break
from devgraph.reference import (
    decode_context,
    decode_runner,
    make_decode_batch,
    make_prefill_batch,
    prefill_context,
    prefill_runner,
)

STRATEGIES = ["full", "breakable", "tc_piecewise"]
DECODE_SIZES = [1, 2, 4, 8]
PREFILL_SIZES = [16, 32, 64]


@pytest.mark.parametrize("mode", STRATEGIES)
@pytest.mark.parametrize("with_context", [False, True])
def test_decode_equals_eager_at_captured_padded_and_fallback_sizes(tiny_model, mode, with_context):
    with decode_runner(tiny_model, mode=mode, sizes=DECODE_SIZES) as runner:
        runner.capture()
        for n in (1, 2, 3, 4, 7, 8, 11):
            batch = make_decode_batch(tiny_model, n, seed=n)
            context = decode_context(batch) if with_context else None
            result = runner.verify(n, context, **batch)
            assert result.replayed == (n <= 8)
            assert result.ok, result
            if with_context and mode == "full" and result.replayed:
                # The graph attends over the whole cache window; eager trims it to the context's
                # max_seq_len. Same maths, float32 sums rounded differently (docs/user-guide.md).
                assert result.max_abs_diff < 1e-4
            else:
                assert result.max_abs_diff == 0.0, (mode, n)


@pytest.mark.parametrize("mode", STRATEGIES)
def test_prefill_equals_eager_packed_requests(tiny_model, mode):
    with prefill_runner(tiny_model, mode=mode, sizes=PREFILL_SIZES) as runner:
        runner.capture()
        for lens in ([16], [5, 9], [20, 12], [30, 34], [40, 33]):
            batch = make_prefill_batch(tiny_model, lens, seed=len(lens))
            result = runner.verify(sum(lens), prefill_context(lens), **batch)
            assert result.replayed == (sum(lens) <= 64)
            assert result.max_abs_diff == 0.0, (mode, lens)
            assert result.ok, result


def test_breakable_cuts_one_segment_per_break(tiny_model):
    with decode_runner(tiny_model, mode="breakable", sizes=[4]) as runner:
        runner.capture()
        plan = runner.backend._entries[4]
        layers = tiny_model.config.num_layers
        assert (plan.num_segments, plan.num_breaks) == (layers + 1, layers)


def test_tc_piecewise_compiles_once_and_never_recompiles(tiny_model):
    with prefill_runner(tiny_model, mode="tc_piecewise", sizes=PREFILL_SIZES) as runner:
        runner.capture()
        backend = runner.backend
        assert backend.num_pieces == tiny_model.config.num_layers + 1
        compiles = backend.compiles
        for lens in ([7], [30, 30], [50, 40]):  # replay, padded replay, eager fallback (compiled)
            batch = make_prefill_batch(tiny_model, lens)
            runner.run(sum(lens), prefill_context(lens), **batch)
        assert backend.compiles == compiles and backend.recompiles == 0


def test_tc_piecewise_reports_a_recompile_after_capture(tiny_model, caplog):
    fn = torch.nn.Linear(4, 4)
    runner = GraphRunner(
        fn.forward,
        phase="prefill",
        mode="tc_piecewise",
        sizes=[8],
        device="cpu",
        inputs={"input": StaticInput(torch.float32, (4,))},
    )
    runner.capture()
    with caplog.at_level(logging.WARNING):
        runner._graph_forward(torch.zeros(2, 4, 4))  # a new rank: dynamo must recompile
    assert runner.backend.recompiles >= 1
    assert "recompiled after capture" in caplog.text


def test_tc_piecewise_can_raise_on_recompile():
    lin = torch.nn.Linear(4, 4)
    runner = GraphRunner(
        lin.forward,
        phase="prefill",
        mode="tc_piecewise",
        sizes=[8],
        device="cpu",
        inputs={"input": StaticInput(torch.float32, (4,))},
    )
    runner.backend.on_recompile = "raise"
    runner.capture()
    with pytest.raises(RecompileError, match="TORCH_LOGS=recompiles"):
        runner._graph_forward(torch.zeros(2, 4, 4))


def test_tc_piecewise_dynamo_graph_break_is_a_capture_error():
    def forward(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 1

    runner = GraphRunner(
        forward,
        phase="prefill",
        mode="tc_piecewise",
        sizes=[8],
        device="cpu",
        inputs={"x": StaticInput(torch.float32)},
    )
    with pytest.raises(CaptureError, match="size 8.*breakable"):
        runner.capture()
    assert runner.backend.captured_keys() == []


@pytest.mark.slow
def test_tc_piecewise_with_inductor(tiny_model):
    with prefill_runner(tiny_model, mode="tc_piecewise", compiler="inductor", sizes=[16, 32]) as runner:
        runner.capture()
        assert runner.backend.compiler == "inductor"
        for lens in ([16], [10, 12]):
            batch = make_prefill_batch(tiny_model, lens)
            result = runner.verify(sum(lens), prefill_context(lens), **batch)
            # Same compiled kernels on the same padded batch: exact. Against plain eager, inductor's
            # fused kernels reorder float32 arithmetic, hence the default relative tolerance.
            assert result.max_abs_diff == 0.0
            assert result.ok, result


# -- break ops and the forward context ----------------------------------------------------------
seen_flags: list[tuple[bool, bool]] = []


@graph_break("devgraph_test::scale_by_context")
def scale_by_context(x: torch.Tensor) -> torch.Tensor:
    """Multiplies by the live context's ``scale``: per-step host state a graph cannot hold."""
    seen_flags.append((devgraph.is_capturing(), devgraph.is_replaying()))
    context = devgraph.get_forward_context()
    return x * (context.scale if context is not None else 1.0)


class Ctx:
    def __init__(self, scale: float) -> None:
        self.scale = scale


def _scaled_forward(x: torch.Tensor) -> torch.Tensor:
    return scale_by_context(x + 1) * 2


def _runner(mode: str) -> GraphRunner:
    return GraphRunner(
        _scaled_forward,
        phase="prefill",
        mode=mode,
        sizes=[4],
        device="cpu",
        inputs={"x": StaticInput(torch.float32)},
        capture_context=lambda size: Ctx(1.0),
    )


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_break_op_reads_live_context_at_replay(mode):
    runner = _runner(mode)
    runner.capture()
    x = torch.arange(4.0)
    for scale in (3.0, -0.5, 10.0):
        seen_flags.clear()
        out = runner.run(4, Ctx(scale), x=x)
        torch.testing.assert_close(out, (x + 1) * scale * 2)
        assert seen_flags == [(False, True)]  # ran eagerly, at replay, outside capture


def test_full_graph_bakes_break_op_in_with_capture_time_context():
    """Why break ops exist: under ``full`` the op is inside the graph and never sees the live context."""
    runner = _runner("full")
    runner.capture()
    x = torch.arange(4.0)
    out = runner.run(4, Ctx(3.0), x=x)
    torch.testing.assert_close(out, (x + 1) * 1.0 * 2)


def test_breakable_holds_strong_references_to_break_inputs():
    runner = _runner("breakable")
    runner.capture()
    plan = runner.backend._entries[4]
    call = next(step for step in plan.steps if hasattr(step, "op"))
    assert call.op is scale_by_context
    assert isinstance(call.args[0], torch.Tensor) and call.outputs.shape == (4,)
