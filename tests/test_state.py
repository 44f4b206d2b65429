"""State a forward mutates besides its inputs: declared state is left as found by ``capture()`` and
``verify()``; undeclared state moves exactly as the runner's docs say."""

from __future__ import annotations

import pytest
import torch

import devgraph
from devgraph import CaptureError, ConfigError, GraphRunner, StaticInput, is_capturing
from devgraph.runner.state import StateHooks

SIZES = [1, 2, 4]
INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0)}
MODES = ["full", "breakable", "tc_piecewise"]


class StepCounter:
    """A forward with an in-place step counter (like Hugging Face's static-cache write position): each
    run adds 1 to ``count`` and scales its output by the new count."""

    def __init__(self) -> None:
        self.count = torch.zeros((), dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x * self.count


def declarations(model: StepCounter) -> dict[str, object]:
    return {
        "tensor list": [model.count],
        "tensor mapping": {"step": model.count},
        "hooks": StateHooks(save=lambda: model.count.clone(), restore=lambda saved: model.count.copy_(saved)),
    }


def make(model: StepCounter, mode: str, state=None, **kwargs) -> GraphRunner:
    return GraphRunner(
        model, phase="decode", inputs=INPUTS, device="cpu", mode=mode, sizes=SIZES, state=state, **kwargs
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["tensor list", "tensor mapping", "hooks"])
def test_declared_counter_is_unchanged_by_capture_and_verify(mode, how):
    model = StepCounter()
    model.count.fill_(10)
    runner = make(model, mode, declarations(model)[how])
    runner.capture()
    assert model.count.item() == 10
    x = torch.ones(3, 4)
    out = runner.run(x=x)  # a real step advances it exactly once
    assert model.count.item() == 11
    torch.testing.assert_close(out, x * 11)
    result = runner.verify(x=x)
    assert result.replayed and result.ok  # graph and eager both started from 11
    assert model.count.item() == 11
    past = runner.verify(x=torch.ones(6, 4))  # eager path: restored too
    assert not past.replayed and past.ok and model.count.item() == 11
    torch.testing.assert_close(runner.run(x=x), x * 12)


@pytest.mark.parametrize("mode", MODES)
def test_undeclared_counter_moves_exactly_as_documented(mode):
    model = StepCounter()
    runner = make(model, mode, warmup_iters=3)
    runner.capture()
    # warmup_iters eager runs per key; the capture itself leaves pre-existing tensors as they were (on a
    # device a capture records kernels without running them; the simulator undoes its writes).
    assert model.count.item() == 3 * len(SIZES)
    runner.run(x=torch.ones(3, 4))
    assert model.count.item() == 3 * len(SIZES) + 1  # one replay: one advance
    before = model.count.item()
    result = runner.verify(x=torch.ones(3, 4))
    assert model.count.item() == before + 3  # the replay, eager on the caller's rows, eager on the buffers
    assert not result.ok  # the three runs saw three different counts: verify says so
    before = model.count.item()
    runner.verify(x=torch.ones(6, 4))  # an eager step: the eager step and eager on the caller's rows
    assert model.count.item() == before + 2


BREAK_COUNT = torch.zeros((), dtype=torch.int64)


@devgraph.graph_break("test_state::bump", mutates_args=("count",))
def bump(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    count.add_(1)
    return x * 2


@pytest.mark.parametrize(("mode", "per_key"), [("full", 1), ("breakable", 2), ("tc_piecewise", 2)])
def test_a_counter_inside_a_break_op_also_moves_at_capture_where_break_ops_run_eagerly(mode, per_key):
    BREAK_COUNT.zero_()
    runner = GraphRunner(
        lambda x: bump(x, BREAK_COUNT) + 1,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode=mode,
        sizes=SIZES,
        warmup_iters=1,
        address_guard=False,  # with one warm-up, the guard's observed run is one more (tests/test_guard.py)
    )
    runner.capture()
    # One warm-up per key; under breakable/tc_piecewise the break op also runs during the capture.
    assert BREAK_COUNT.item() == per_key * len(SIZES)
    runner.run(x=torch.ones(2, 4))
    assert BREAK_COUNT.item() == per_key * len(SIZES) + 1


def test_undeclared_counter_in_disabled_mode_moves_once_per_run():
    model = StepCounter()
    runner = make(model, "disabled")
    runner.capture()
    assert model.count.item() == 0
    runner.run(x=torch.ones(3, 4))
    runner.verify(x=torch.ones(3, 4))
    assert model.count.item() == 1 + 2


@pytest.mark.parametrize(("output_axes", "probe_runs"), [(["tokens"], 0), (None, 1)])
def test_capture_does_not_change_pre_existing_tensors_on_the_simulator(output_axes, probe_runs):
    writes = torch.zeros(4)
    calls = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        writes.add_(1)  # an in-place write to a tensor that existed before the capture
        return x + writes

    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="full",
        sizes=[2],
        warmup_iters=0,
        output_axes=output_axes,
    )
    runner.capture()
    # As on a device, the capture records the write without running it. With one captured size and no
    # output_axes=, the runner runs the forward once more (eagerly, at 1 row) to learn the output layout.
    assert calls == [2] + [1] * probe_runs
    assert writes.tolist() == [probe_runs] * 4
    runner.run(x=torch.zeros(2, 4))
    assert writes.tolist() == [probe_runs + 1] * 4


def test_state_restored_when_capture_fails():
    model = StepCounter()

    def failing(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        if x.shape[0] == 2 and is_capturing():
            out.sum().item()  # a host sync, only when capturing size 2
        return out

    runner = GraphRunner(
        failing, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES, state=[model.count]
    )
    with pytest.raises(CaptureError):
        runner.capture()
    assert model.count.item() == 0  # 2 warm-ups each for sizes 4 and 2 ran, and were undone


def test_bad_state_declarations_are_config_errors():
    model = StepCounter()
    with pytest.raises(ConfigError, match="state= takes tensors"):
        make(model, "full", [model.count, 3])
    with pytest.raises(ConfigError, match="state= must be a tensor, a list or a mapping"):
        make(model, "full", "count")


def test_inspect_shows_declared_state():
    model = StepCounter()
    hooks = declarations(model)["hooks"]
    runner = make(model, "full", [model.count, hooks])
    assert runner.inspect()["state"] == {"tensors": {"0": "torch.int64 () on cpu"}, "hooks": 1, "auto": False}
