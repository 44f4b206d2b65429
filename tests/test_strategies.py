"""Every strategy end to end on the reference model (CPU simulated graphs), with both attention forms;
compiled ``full``; break-op semantics and break-op memory shared across sizes.

``runner.verify`` compares a replay with eager on the runner's own padded buffers (``max_abs_diff``: the
same code on the same shapes, so 0 unless the graph baked in something eager reads afresh) and with eager
on the caller's rows (``ok`` bounds both by the default relative tolerance).
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from conftest import chained_breaks

import devgraph
from devgraph import CaptureError, GraphKey, GraphRunner, RecompileError, StaticInput, graph_break
from devgraph.contract.keys import REQUESTS
from devgraph.errors import ReplayError
from devgraph.reference import (
    ReferenceConfig,
    ReferenceModel,
    batch_context,
    decode_runner,
    make_decode_batch,
    make_prefill_batch,
    make_verify_batch,
    prefill_runner,
    verify_runner,
)
from devgraph.strategies.segments import BreakCall

STRATEGIES = ["full", "breakable", "tc_piecewise"]
ATTENTIONS = ["paged", "sdpa"]
DECODE_SIZES = [1, 2, 4, 8]
PREFILL_SIZES = [16, 32, 64]


def _model(attention: str = "paged") -> ReferenceModel:
    """A tiny model (seed 0) whose cache holds random history; a short window and few requests keep the
    CPU reference attention (it reads whole block tables) cheap."""
    config = ReferenceConfig.preset("tiny", attention=attention, max_seq_len=64, max_requests=16)
    model = ReferenceModel(config, seed=0)
    model.randomize_cache(0)
    return model


def _full_without_host_lengths(mode: str, attention: str, context: object, replayed: bool) -> bool:
    """``full`` captured the sdpa op with no host lengths, so it replays the device-metadata reference
    while eager with a context takes the host-length path: the same attention, rounded differently."""
    return mode == "full" and attention == "sdpa" and context is not None and replayed


def _assert_matches_eager(result: devgraph.VerifyResult, near: bool) -> None:
    assert result.ok, result
    if near:
        assert result.max_abs_diff <= 1e-5 * result.scale, result
    else:
        assert result.max_abs_diff == 0.0, result


# -- every strategy, both attention forms ---------------------------------------------------------------
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("mode", STRATEGIES)
def test_decode_equals_eager_at_captured_padded_and_fallback_sizes(mode, attention):
    model = _model(attention)
    with decode_runner(model, mode=mode, sizes=DECODE_SIZES) as runner:
        runner.capture()
        assert runner.keys == [GraphKey.of(s, {REQUESTS: s}) for s in DECODE_SIZES]
        for n in (1, 2, 3, 4, 7, 8, 11):
            batch = make_decode_batch(model, n, seed=n)
            # The paged form never reads the context; the sdpa one with and without host lengths.
            for context in (batch_context(batch), None) if attention == "sdpa" else (None,):
                result = runner.verify(n, context, **batch)
                assert result.replayed == (n <= 8) and result.size == runner.bucket(n)
                _assert_matches_eager(result, _full_without_host_lengths(mode, attention, context, n <= 8))
        if mode == "tc_piecewise":  # one compile for every size, batch size 1 included
            assert (runner.inspect()["compiles"], runner.inspect()["recompiles"]) == (1, 0)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("mode", STRATEGIES)
def test_prefill_equals_eager_packed_requests(mode, attention):
    model = _model(attention)
    with prefill_runner(model, mode=mode, sizes=PREFILL_SIZES, axes={REQUESTS: 8}) as runner:
        runner.capture()
        assert [k.size(REQUESTS) for k in runner.keys] == [8, 8, 8]  # at most 8 requests per step
        # One request, chunks after a cached prefix, many short requests, past the largest on each axis.
        cases = [[16], [5, 9], [20, 12], [1] * 8, [1] * 9, [40, 33]]
        for lens in cases:
            prefixes = [(7 * r) % 31 for r in range(len(lens))]
            batch = make_prefill_batch(model, lens, prefix_lens=prefixes, seed=len(lens))
            context = batch_context(batch)
            result = runner.verify(sum(lens), context, **batch)
            assert result.replayed == (sum(lens) <= 64 and len(lens) <= 8), lens
            _assert_matches_eager(
                result, _full_without_host_lengths(mode, attention, context, result.replayed)
            )


@pytest.mark.parametrize("mode", STRATEGIES)
def test_verify_phase_k3_equals_eager(mode):
    """Speculative-decoding verify steps (1 + 3 tokens per request), padded by whole requests."""
    model = _model("sdpa")
    with verify_runner(model, 4, mode=mode, sizes=[4, 8, 16]) as runner:
        runner.capture()
        assert runner.keys == [GraphKey.of(4 * b, {REQUESTS: b}) for b in (1, 2, 4)]
        for requests in (1, 3, 4, 5):
            batch = make_verify_batch(model, requests, 4, seed=requests)
            result = runner.verify(4 * requests, batch_context(batch), **batch)
            assert result.replayed == (requests <= 4)
            _assert_matches_eager(result, _full_without_host_lengths(mode, "sdpa", True, result.replayed))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_breakable_cuts_one_segment_per_break(attention):
    """The sdpa op is a break op (one per layer); the paged kernels are captured whole."""
    model = _model(attention)
    layers = model.config.num_layers
    with decode_runner(model, mode="breakable", sizes=[4]) as runner:
        runner.capture()
        key = runner.inspect()["keys"]["tokens=4,requests=4"]
        expected = (layers + 1, layers) if attention == "sdpa" else (1, 0)
        assert (key["segments"], key["break_ops"]) == expected


def test_tc_piecewise_compiles_once_and_never_recompiles():
    model = _model("sdpa")
    with prefill_runner(model, mode="tc_piecewise", sizes=PREFILL_SIZES) as runner:
        runner.capture()
        info = runner.inspect()
        assert (info["pieces"], info["break_ops"]) == (model.config.num_layers + 1, model.config.num_layers)
        assert (info["compiles"], info["recompiles"]) == (1, 0)
        for lens in ([7], [30, 30], [50, 40]):  # replay, padded replay, eager fallback (compiled)
            batch = make_prefill_batch(model, lens)
            runner.run(context=batch_context(batch), **batch)
            assert runner.verify(context=batch_context(batch), **batch).max_abs_diff == 0.0
        assert (runner.inspect()["compiles"], runner.inspect()["recompiles"]) == (1, 0)


def _linear_runner(**kwargs) -> GraphRunner:
    lin = torch.nn.Linear(4, 4)
    return GraphRunner(
        lin.forward,
        phase="prefill",
        sizes=[8],
        device="cpu",
        inputs={"input": StaticInput(torch.float32, (4,))},
        **kwargs,
    )


def test_tc_piecewise_reports_a_recompile_after_capture(caplog):
    runner = _linear_runner(mode="tc_piecewise")
    runner.capture()
    compiled = runner.backend.wrap_forward(runner.forward)  # what the runner captured and falls back to
    with caplog.at_level(logging.WARNING):
        compiled(torch.zeros(2, 4, 4))  # a new rank: dynamo must recompile
    assert runner.inspect()["recompiles"] >= 1
    assert "recompiled after capture" in caplog.text


def test_tc_piecewise_can_raise_on_recompile():
    runner = _linear_runner(
        config=json.dumps({"prefill": {"backend": "tc_piecewise", "on_recompile": "raise"}})
    )
    runner.capture()
    with pytest.raises(RecompileError, match="TORCH_LOGS=recompiles"):
        runner.backend.wrap_forward(runner.forward)(torch.zeros(2, 4, 4))


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
    with pytest.raises(CaptureError, match="tokens=8.*breakable"):
        runner.capture()
    assert runner.backend.captured_keys() == []


@pytest.mark.slow
def test_tc_piecewise_with_inductor():
    model = _model("sdpa")
    with prefill_runner(model, mode="tc_piecewise", compiler="inductor", sizes=[16, 32]) as runner:
        runner.capture()
        assert runner.inspect()["compiler"] == "inductor"
        for lens in ([16], [10, 12]):
            batch = make_prefill_batch(model, lens)
            result = runner.verify(sum(lens), batch_context(batch), **batch)
            # Same compiled kernels on the same padded batch: exact. Against plain eager, inductor's
            # fused kernels reorder float32 arithmetic, hence the default relative tolerance.
            assert result.max_abs_diff == 0.0
            assert result.ok, result
        assert runner.inspect()["recompiles"] == 0


# -- compiled full ------------------------------------------------------------------------------------
def _check_compiled_full(runner: GraphRunner, steps: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
    """Captured once for every size; each step equals the compiled forward run eagerly on the same padded
    buffers (exactly) and the plain model (within tolerance); no recompile at any size or in verify()."""
    runner.capture()
    info = runner.inspect()
    assert (info["compiles"], info["recompiles"]) == (1, 0), info
    assert len(info["keys"]) == len(runner.sizes)
    for n, batch in steps:
        result = runner.verify(n, None, **batch)
        assert result.max_abs_diff == 0.0, (n, result)
        assert result.ok, (n, result)
        torch.testing.assert_close(runner.run(n, **batch), runner.forward(**batch), rtol=1e-4, atol=1e-4)
    after = runner.inspect()
    assert (after["compiles"], after["recompiles"]) == (1, 0), after
    assert runner.stats()["replays"] > 0 and runner.stats()["eager_by_reason"]["past_largest"] > 0


def _decode_steps(model: ReferenceModel) -> list[tuple[int, dict[str, torch.Tensor]]]:
    return [(n, make_decode_batch(model, n, seed=n)) for n in (1, 2, 3, 4, 6, 8, 11)]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_full_compiled_with_eager_compiles_once_for_every_size(attention):
    model = _model(attention)
    with decode_runner(model, mode="full", compiler="eager", sizes=DECODE_SIZES) as runner:
        assert runner.inspect()["compiler"] == "eager"
        _check_compiled_full(runner, _decode_steps(model))


def test_full_compiled_prefill_compiles_once_for_every_key():
    model = _model()
    flag = json.dumps({"prefill": {"backend": "full", "compiler": "eager"}})
    with prefill_runner(model, config=flag, sizes=PREFILL_SIZES) as runner:
        steps = []
        for lens in ([3], [5, 9], [20, 12, 1], [30, 34], [40, 33]):
            steps.append((sum(lens), make_prefill_batch(model, lens, seed=len(lens))))
        _check_compiled_full(runner, steps)


@pytest.mark.slow
def test_full_compiled_with_inductor_compiles_once_for_every_size():
    model = _model()
    flag = json.dumps({"decode": {"backend": "full", "compiler": "inductor", "inductor_mode": "default"}})
    with decode_runner(model, config=flag, sizes=DECODE_SIZES) as runner:
        assert runner.backend.options.inductor_mode == "default"
        assert runner.inspect()["compiler"] == "inductor"
        _check_compiled_full(runner, _decode_steps(model))


# -- break ops and the forward context ----------------------------------------------------------------
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


class StaticCtx(Ctx):
    """A context whose ``scale`` a graph may keep from its capture (declared static)."""

    __devgraph_static__ = ("scale",)


def _scaled_forward(x: torch.Tensor) -> torch.Tensor:
    return scale_by_context(x + 1) * 2


def _runner(mode: str, context: type[Ctx] = Ctx) -> GraphRunner:
    return GraphRunner(
        _scaled_forward,
        phase="prefill",
        mode=mode,
        sizes=[4],
        device="cpu",
        inputs={"x": StaticInput(torch.float32)},
        capture_context=lambda key: context(1.0),
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
    """Why break ops exist: under ``full`` the op is inside the graph and never sees the live context; a
    replay whose context holds another value is refused (it would compute with the capture's), one whose
    value is declared static replays the capture's on purpose."""
    runner = _runner("full")
    runner.capture()
    x = torch.arange(4.0)
    with pytest.raises(ReplayError, match=r"baked in a host value.*context\.scale was 1\.0 at capture"):
        runner.run(4, Ctx(3.0), x=x)
    torch.testing.assert_close(runner.run(4, Ctx(1.0), x=x), (x + 1) * 1.0 * 2)
    static = _runner("full", StaticCtx)
    static.capture()
    out = static.run(4, Ctx(3.0), x=x)
    torch.testing.assert_close(out, (x + 1) * 1.0 * 2)


def test_breakable_records_each_break_op_with_its_arguments_and_outputs():
    """The replay plan calls the op on its capture-time tensors and writes where the next segment reads.
    (On a GPU these are weak aliases into the graph pool, see test_cuda; the CPU keeps the tensors.)"""
    runner = _runner("breakable")
    runner.capture()
    plan = runner.backend._entries[runner.keys[0]]
    (call,) = [step for step in plan.steps if isinstance(step, BreakCall)]
    assert call.op is scale_by_context
    assert isinstance(call.args[0], torch.Tensor) and call.args[0].shape == (4,)
    assert call.outputs.shape == (4,)
    assert runner.inspect()["keys"]["tokens=4"] == {
        **runner.inspect()["keys"]["tokens=4"],
        "segments": 2,
        "break_ops": 1,
    }


# -- break-op memory shared across sizes ---------------------------------------------------------------
def _replay_in_random_orders(
    runner: GraphRunner, steps: dict[int, tuple[object, dict[str, torch.Tensor]]], seed: int = 0
) -> None:
    """Each step runs (replay, or eager past the largest size) and is verified, in four random orders."""
    order = list(steps)
    rng = random.Random(seed)
    for _ in range(4):
        rng.shuffle(order)
        for n in order:
            context, batch = steps[n]
            out = runner.run(n, context, copy=True, **batch)
            result = runner.verify(n, context, **batch)
            assert result.max_abs_diff == 0.0 and result.ok, (order, n, result)
            with devgraph.forward_context(context), torch.no_grad():
                expected = runner.forward(**batch)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    stats = runner.stats()
    eager = sum(n > runner.sizes[-1] for n in order)
    assert eager > 0 and stats["eager_by_reason"]["past_largest"] == 4 * eager
    assert stats["replays"] == 4 * (len(order) - eager)


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_break_ops_replay_exactly_in_any_size_order(mode):
    """Break-op tensors live in the shared pool and are reused across sizes (only one size replays at a
    time): replaying sizes in random orders, interleaved with eager steps past the largest, stays exact.
    On the CPU this checks the plan logic; test_cuda checks the pool aliasing itself."""
    runner = GraphRunner(
        chained_breaks,
        phase="prefill",
        mode=mode,
        sizes=[2, 4, 8, 16],
        device="cpu",
        inputs={"x": StaticInput(torch.float32, (3,)), "bias": StaticInput(torch.float32, (3,))},
    )
    with runner:
        runner.capture()
        gen = torch.Generator().manual_seed(0)
        steps: dict[int, tuple[object, dict[str, torch.Tensor]]] = {}
        for n in (1, 2, 3, 5, 8, 13, 16, 17, 30):
            steps[n] = (
                None,
                {"x": torch.randn(n, 3, generator=gen), "bias": torch.randn(n, 3, generator=gen)},
            )
        _replay_in_random_orders(runner, steps)


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_a_break_op_runs_outside_the_graph_pool_and_only_its_outputs_go_into_it(mode, monkeypatch):
    """The op's temporaries stay out of the graph pool (a pool keeps whatever it ever held reserved while
    its graphs live; an attention break op's gathered K/V made that 20x full's prefill memory on an H100):
    the op runs on the ordinary allocator, then its outputs are copied into the pool."""
    from devgraph.platforms.sim.platform import CpuSimPlatform

    in_pool = [False]
    events: list[tuple[str, bool]] = []

    class Routing:
        def __enter__(self) -> None:
            in_pool[0] = True

        def __exit__(self, *exc: object) -> None:
            in_pool[0] = False

    monkeypatch.setattr(CpuSimPlatform, "allocate_into", lambda self, pool: Routing())

    @graph_break("devgraph_test::records_pool_routing")
    def records_pool_routing(x: torch.Tensor) -> torch.Tensor:
        events.append(("op", in_pool[0]))
        return x * 3.0

    runner = GraphRunner(
        lambda x: records_pool_routing(x + 1.0) - 1.0,
        phase="prefill",
        inputs={"x": StaticInput(torch.float32, (4,))},
        sizes=[2, 4],
        device="cpu",
        mode=mode,
    )
    with runner:
        runner.capture()
        assert events and all(not routed for _, routed in events), events
        x = torch.randn(3, 4)
        torch.testing.assert_close(runner.run(x=x), (x + 1.0) * 3.0 - 1.0)
        assert runner.verify(x=x).max_abs_diff == 0.0


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_reference_break_ops_replay_exactly_in_any_size_order(mode):
    model = _model("sdpa")
    with decode_runner(model, mode=mode, sizes=DECODE_SIZES) as runner:
        runner.capture()
        steps = {}
        for n in (1, 2, 3, 5, 8, 10):
            batch = make_decode_batch(model, n, seed=10 + n)
            steps[n] = (batch_context(batch), batch)
        _replay_in_random_orders(runner, steps, seed=1)


def test_tc_piecewise_eager_pieces_are_captured_op_by_op_so_a_host_sync_is_caught():
    # An eager-compiled piece runs its FX graph under the simulator's recorder, so `.item()` inside it fails
    # capture as on a device, instead of being recorded whole and re-read live at every replay.
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        return y + float(y.sum().item())

    runner = GraphRunner(
        forward,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (4,))},
        sizes=[1, 2],
        mode="tc_piecewise",
    )
    with pytest.raises(CaptureError, match=r"\.item\(\)"):
        runner.capture()
    assert runner.backend.captured_keys() == []


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_a_break_op_whose_output_shape_changes_at_replay_raises_a_replay_error_naming_it(mode):
    @graph_break("devgraph_test::rows_from_context", fake=lambda x: x.new_empty(x.shape))
    def rows_from_context(x: torch.Tensor) -> torch.Tensor:
        rows = getattr(devgraph.get_forward_context(), "rows", x.shape[0])
        return torch.ones(rows, x.shape[1])  # shaped by a host value: not allowed for break ops

    runner = GraphRunner(
        lambda x: rows_from_context(x * 2) + 1,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (4,))},
        device="cpu",
        mode=mode,
        sizes=[2, 4],
    )
    runner.capture()
    with pytest.raises(devgraph.ReplayError, match="rows_from_context"):
        runner.run(x=torch.ones(4, 4), context=type("Ctx", (), {"rows": 3})())
