"""``GraphRunner.submit()``: a step that returns once its work is issued, with a handle to wait on (an event
recorded on the replay stream after the step), on every path (graph or eager) and every platform (the CPU
simulator's work is done when issued; a CUDA step is not)."""

from __future__ import annotations

import pytest
import torch

from devgraph import DeviceEvent, GraphRunner, HostCopy, InputError, StaticInput, StepHandle

pytestmark = pytest.mark.timeout(120)

INPUTS = {"x": StaticInput(torch.float32, (16,), fill=0.0)}


def make(device: str = "cpu", **kwargs: object) -> tuple[GraphRunner, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(16, 16, device=device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    kwargs.setdefault("mode", "full")
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device=device, sizes=[1, 2, 4], **kwargs)  # type: ignore[arg-type]
    return runner, weight


@pytest.mark.parametrize("mode", ["full", "eager"])
def test_submit_hands_out_the_step_and_an_event_on_the_cpu(mode: str) -> None:
    runner, weight = make(mode=mode)
    runner.capture()
    x = torch.randn(3, 16)
    handle = runner.submit(x=x)
    assert isinstance(handle, StepHandle) and isinstance(handle.event, DeviceEvent)
    assert handle.ready()  # the simulator's work is done when issued
    assert handle.wait() is handle.outputs
    torch.testing.assert_close(handle.outputs, torch.tanh(x @ weight))
    stats = runner.stats()
    assert stats["steps"] == 1 and stats["replays"] == (1 if mode == "full" else 0)
    runner.close()


def test_submit_takes_runs_arguments() -> None:
    runner, weight = make()
    runner.capture()
    x = torch.randn(2, 16)
    owned = runner.submit(x=x, copy=True).wait()
    into = torch.empty(2, 16)
    assert runner.submit(x=x, out=into).wait() is into
    torch.testing.assert_close(owned, into)
    with pytest.raises(InputError, match="copy=True or out="):
        runner.submit(x=x, copy=True, out=into)
    with pytest.raises(InputError, match="expected"):
        runner.submit(x=torch.randn(2, 15))
    runner.close()


def test_to_host_copies_what_the_step_computed_and_never_aliases_a_buffer() -> None:
    runner, weight = make()
    runner.capture()
    x = torch.randn(3, 16)
    handle = runner.submit(x=x)
    tokens = handle.outputs.argmax(-1)  # what an engine computes after the step (sampling)
    copy = runner.to_host(tokens, handle.outputs)
    assert isinstance(copy, HostCopy) and copy.ready()
    host_tokens, host_outputs = copy.wait()
    expected = torch.tanh(x @ weight)
    torch.testing.assert_close(host_outputs, expected)
    assert torch.equal(host_tokens, expected.argmax(-1))
    runner.submit(x=torch.randn(3, 16))  # the next step rewrites the graph's output buffer
    torch.testing.assert_close(host_outputs, expected)  # the copy does not follow it
    runner.close()


@pytest.mark.cuda
def test_cuda_to_host_lands_in_pinned_memory_after_the_event() -> None:
    runner, weight = make("cuda")
    runner.capture()
    x = torch.randn(4, 16, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    handle = runner.submit(x=x)
    for _ in range(20):  # keep the stream busy so the copy is still in flight when to_host returns
        big = big @ big / 64
    copy = runner.to_host(handle.outputs.argmax(-1), big[:1, :4])
    (tokens, _) = copy.wait()
    assert tokens.is_pinned() and not tokens.is_cuda
    assert torch.equal(tokens, torch.tanh(x @ weight).argmax(-1).cpu())
    runner.close()


@pytest.mark.cuda
def test_cuda_submit_returns_before_the_device_finishes_and_wait_orders_the_read() -> None:
    runner, weight = make("cuda")
    runner.capture()
    x = torch.randn(4, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy, so the step queued behind it is not done yet
    handle = runner.submit(x=x)
    assert isinstance(handle.event, torch.cuda.Event)
    assert not handle.ready()  # issued, not finished
    outputs = handle.wait()
    assert handle.ready()
    torch.testing.assert_close(outputs, torch.tanh(x @ weight))
    runner.close()


@pytest.mark.parametrize("given", [3, "tokens", [torch.ones(2)]])
def test_to_host_refuses_what_is_not_a_tensor_by_name(given: object) -> None:
    runner, _ = make()
    with pytest.raises(InputError, match=r"to_host\(\) copies tensors: argument 1 is"):
        runner.to_host(torch.ones(2), given)  # type: ignore[arg-type]
    runner.close()
