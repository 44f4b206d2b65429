"""Regional compilation (``full`` with ``regions=True``): the model's repeated block compiled once for every
layer and size, the rest of the forward run as it is, the whole step captured in one graph."""

from __future__ import annotations

from typing import Any

import torch
from zoo import CPU_TINY, build

from devgraph import GraphRunner, create_backend
from devgraph.strategies.regions import repeated_block

SHAPE = CPU_TINY.with_(layers=3, max_batch=4, max_len=32)


def runner_for(name: str, compiler: str = "eager", **options: Any) -> tuple[Any, GraphRunner]:
    model = build(name, SHAPE)
    backend = create_backend("cpu", model.phase, "full", options={"compiler": compiler, **options})
    runner = GraphRunner(
        model.forward, device="cpu", sizes=[1, 2, 4], backend=backend, progress=False, **model.runner_kwargs()
    )
    return model, runner


def test_the_repeated_block_compiles_once_for_every_layer_and_size():
    model, runner = runner_for("gptfast", regions=True)
    runner.capture()
    info = runner.inspect()
    assert info["regions"] == {"block": "Block", "modules": "layers", "count": SHAPE.layers}
    assert (info["compiles"], info["recompiles"]) == (1, 0)  # one layer's graph, not the whole forward's
    layers = model.module.layers
    assert all("forward" not in layer.__dict__ for layer in layers)  # the modules are left as they were
    with torch.no_grad():
        for n in (1, 3, 4):
            step = model.make_step(n, n)
            torch.testing.assert_close(runner.run(copy=True, **step), model.forward(**step))


def test_without_a_repeated_block_the_whole_forward_compiles_and_says_why():
    _, runner = runner_for("plain", regions=True)  # its layers are ParameterLists, not modules
    runner.capture()
    regions = runner.inspect()["regions"]
    assert regions["block"] is None and "compiled whole" in regions["why"]


def test_repeated_block_picks_the_largest_list_of_one_class():
    class Block(torch.nn.Linear):
        pass

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()])  # mixed classes
            self.layers = torch.nn.ModuleList(Block(2, 2) for _ in range(3))
            self.pair = torch.nn.ModuleList(Block(2, 2) for _ in range(2))

    found = repeated_block(Net())
    assert found is not None and found[0] == "layers" and len(found[1]) == 3
    assert repeated_block(lambda x: x) is None
