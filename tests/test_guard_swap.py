"""torch's swap mode (``torch.__future__.set_swap_module_params_on_conversion(True)``) beside a live runner:
``load_state_dict()`` swaps each parameter for a new tensor. devgraph holds no weak reference to a tensor
(torch refuses to swap one that has any), the address guard then names the swapped weights before a replay
reads the old memory, and where the graphs themselves hold the tensors (the CPU simulator, a compiled
forward) torch's error says what devgraph needs: release, load, restore."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from devgraph import GraphRunner, ReplayError, StaticInput

pytestmark = pytest.mark.timeout(120)

INPUTS = {"x": StaticInput(torch.float32, (16,))}


@pytest.fixture
def swap_mode() -> Iterator[None]:
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _model_and_runner(device: str = "cpu") -> tuple[Mlp, GraphRunner]:
    torch.manual_seed(0)
    model = Mlp().to(device)
    runner = GraphRunner(model, phase="decode", inputs=INPUTS, device=device, mode="full", sizes=[1, 2, 4])
    return model, runner


def _shifted(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() + 0.5 for name, value in model.state_dict().items()}


def test_the_guard_holds_no_weak_reference_to_a_tensor():
    model, runner = _model_and_runner()
    runner.capture()
    for tensor in [*model.parameters(), *model.buffers()]:
        assert weakref.getweakrefs(tensor) == []
    runner.close()


@pytest.mark.usefixtures("swap_mode")
def test_a_swap_the_graphs_block_says_release_and_restore_and_that_order_works():
    # before: torch's weakref error alone ("Cannot swap t1 because it has weakref associated with it")
    model, runner = _model_and_runner()
    runner.capture()
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(_shifted(model))
    message = str(info.value)
    assert "devgraph" in message and "runner.release()" in message and "runner.restore()" in message
    torch.testing.assert_close(runner.run(x=x), model(x))  # nothing was swapped: the graphs stay valid
    runner.release()
    gc.collect()
    model.load_state_dict(_shifted(model))  # the graphs are gone: the swap goes through
    runner.restore()
    torch.testing.assert_close(runner.run(x=x), model(x))
    runner.close()


@pytest.mark.cuda
@pytest.mark.usefixtures("swap_mode")
def test_cuda_weights_loaded_under_swap_mode_never_replay_stale():
    # A CUDA graph holds addresses, not the weights: the swap goes through (it failed on devgraph's weak
    # references before). Whether the swapped-in weights sit at the old addresses depends on torch (the
    # torch of this writing keeps them there, values new); either way a replay never reads stale weights:
    # the graphs replay the new values, or the guard refuses and refresh() captures on the new tensors.
    model, runner = _model_and_runner("cuda")
    runner.capture()
    x = torch.randn(3, 16, device="cuda")
    before = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    model.load_state_dict(_shifted(model))
    gc.collect()
    moved = any(p.untyped_storage().data_ptr() != before[n] for n, p in model.named_parameters())
    if moved:
        with pytest.raises(ReplayError, match="refresh"):
            runner.run(x=x)
        runner.refresh()
    torch.testing.assert_close(runner.run(x=x), model(x))
    runner.close()


def test_a_swap_is_an_event_even_where_the_old_storage_stays_alive():
    # On a GPU the graphs hold addresses, and the old storage may live on elsewhere, so no storage is freed
    # and a swapped parameter is the same object: only the swap itself can tell the guard to look (the CUDA
    # test above shows the whole path; on the CPU the simulated graph holds the tensors, which refuses it).
    from devgraph.runner.guard import events

    events.install()
    a, b = torch.zeros(4), torch.ones(4)
    kept = a.untyped_storage()  # the old storage stays alive
    before = events.epoch()
    torch.utils.swap_tensors(a, b)
    assert events.epoch() > before and a.untyped_storage().data_ptr() != kept.data_ptr()
    assert torch.utils.swap_tensors.__wrapped__ is not None  # one wrap, whatever installs it again
    events.install()
    assert not hasattr(torch.utils.swap_tensors.__wrapped__, "__wrapped__")
