"""``torch.compile`` lifetime under ``tc_piecewise``: runners over one forward come and go, verify() does not
recompile, and a real recompile after capture is reported (or raised with ``on_recompile="raise"``)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from devgraph import GraphRunner, RecompileError, StaticInput, resolve_platform
from devgraph.contract.backend import BackendOptions
from devgraph.strategies import CompilingStrategy, TcPiecewiseBackend
from devgraph.strategies.full import FullEntry

INPUTS = {"x": StaticInput(torch.float32, (3,), fill=0.0)}
W = torch.arange(9, dtype=torch.float32).reshape(3, 3) / 10
FLAGS = {"double": False}  # a Python value the forward branches on: dynamo guards on it


def forward(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x @ W.to(x.dtype))
    return y * 2 if FLAGS["double"] else y


def make(**kwargs) -> GraphRunner:
    kwargs.setdefault("mode", "tc_piecewise")
    return GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=[1, 2], **kwargs)


def test_ninth_runner_over_one_forward_captures():
    # dynamo's cache entries would pile up on the forward's code object and hit the recompile limit (8).
    for i in range(10):
        runner = make()
        runner.capture()
        x = torch.full((2, 3), float(i))
        torch.testing.assert_close(runner.run(x=x), forward(x))
        info = runner.inspect()
        assert (info["compiles"], info["recompiles"]) == (1, 0), f"runner {i + 1}"
        runner.close()


def test_verify_after_capture_neither_recompiles_nor_warns(caplog):
    runner = make()
    runner.capture()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for n in (
            1,
            2,
            3,
        ):  # a captured size, the largest, past the largest (eager through the compiled forward)
            assert runner.verify(n, x=torch.ones(n, 3)).ok
    assert runner.inspect()["recompiles"] == 0
    assert runner.inspect()["compiles"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_on_recompile_raise_from_the_flag():
    runner = make(mode=None, config='{"decode": {"backend": "tc_piecewise", "on_recompile": "raise"}}')
    assert runner.backend.options.on_recompile == "raise"
    runner.capture()
    compiled = runner.backend.wrap_forward(forward)  # the forward the runner captured and falls back to
    with pytest.raises(RecompileError, match="recompiled after capture"):
        compiled(x=torch.ones(2, 3, dtype=torch.float64))  # another dtype: a guard fails
    assert runner.inspect()["recompiles"] == 1


def test_on_recompile_raise_from_backend_options_and_eager_steps_never_compile():
    from devgraph import resolve_platform

    backend = TcPiecewiseBackend(
        resolve_platform("cpu"), phase="decode", options=BackendOptions(on_recompile="raise")
    )
    runner = make(mode=None, backend=backend)
    runner.capture()
    FLAGS["double"] = True  # a Python value the compiled forward branched on changes
    try:
        runner.run(x=torch.ones(2, 3))  # a replay never enters dynamo
        # Eager steps run the plain forward: past the largest size nothing compiles, whatever changed.
        torch.testing.assert_close(runner.run(x=torch.ones(3, 3)), forward(torch.ones(3, 3)))
        assert runner.inspect()["recompiles"] == 0
        # verify() runs the compiled forward on the padded buffers: there the guard fails and raises.
        with pytest.raises(RecompileError, match="TORCH_LOGS=recompiles"):
            runner.verify(x=torch.ones(2, 3))
    finally:
        FLAGS["double"] = False


def test_on_recompile_warn_counts_and_logs(caplog):
    runner = make()
    runner.capture()
    with caplog.at_level(logging.WARNING, logger="devgraph.strategies"):
        runner.backend.wrap_forward(forward)(x=torch.ones(2, 3, dtype=torch.float64))
    assert runner.inspect()["recompiles"] == 1
    assert any("recompiled after capture" in r.getMessage() for r in caplog.records)


def test_a_size_equal_to_the_row_width_does_not_compile_twice():
    square = {"x": StaticInput(torch.float32, (4,), fill=0.0)}
    runner = GraphRunner(
        lambda x: x * 2, phase="decode", inputs=square, device="cpu", mode="tc_piecewise", sizes=[2, 4]
    )
    runner.capture()
    assert runner.inspect()["compiles"] == 1


class _PieceCounter(CompilingStrategy):
    """A plug-in's own compiling strategy on the shared compile hooks: it says only how dynamo's graph
    becomes code (here: run as traced, counting the graphs) and captures each key whole."""

    name = "piece_counter"
    accepts_compiler = True
    default_compiler = "eager"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs = 0

    def wrap_forward(self, forward):
        return self.compile.wrap(forward, self._dynamo_backend)

    def _compile_graph(self, gm, example_inputs):
        self.graphs += 1
        return gm

    def _capture(self, key, forward_fn):
        graph = self.platform.new_graph()
        self.platform.capture_begin(graph, self._pool)
        outputs = self.platform.record_opaque(forward_fn)
        self.platform.capture_end(graph)
        return FullEntry(graph, outputs)


def test_a_plugin_compiling_strategy_gets_the_compile_hooks():
    """Counting compiles, the seal after capture (a recompile is reported), describe(): all from the base."""
    backend = _PieceCounter(resolve_platform("cpu"), phase="decode")
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, sizes=[1, 2], backend=backend)
    runner.capture()
    x = torch.ones(2, 3)
    torch.testing.assert_close(runner.run(x=x), forward(x))
    info = runner.inspect()
    assert (info["compiler"], info["compiles"], info["recompiles"]) == ("eager", 1, 0)
    assert backend.graphs == 1 and (backend.compiles, backend.recompiles) == (1, 0)
    FLAGS["double"] = True  # the guard fails: a compile after capture is a recompile, reported
    try:
        runner.verify(x=torch.ones(2, 3))  # verify() runs the compiled forward on the padded buffers
    finally:
        FLAGS["double"] = False
    assert runner.inspect()["recompiles"] == 1
    runner.close()
