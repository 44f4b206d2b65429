"""The zoo (``tests/zoo``) under every strategy on the CPU: each model's graph equals the same code run
eagerly on the same padded inputs (bit for bit: same kernels; a compiled graph against the same compiled
code), and eager on the caller's rows within tolerance; or capture is refused with a message naming the
cause. Never a silent difference.

Cost: ``full`` and ``breakable`` of every model run by default (seconds); ``tc_piecewise`` (dynamo traces
each model) and ``full`` + inductor are marked ``slow``. Inductor runs on the ``plain`` decoder (the
pattern compiled ``full`` once failed on) by default; ``DEVGRAPH_INDUCTOR_ALL=1`` runs it on every model
(minutes on two cores; the GPU benchmark ``benchmarks/bench_zoo.py`` runs compiled ``full`` on every model).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import zoo

from devgraph import CaptureError, GraphRunner

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SIZES = [1, 2, 4]
INDUCTOR_ALL = os.environ.get("DEVGRAPH_INDUCTOR_ALL") == "1"


def _param(name: str, *marks: pytest.MarkDecorator) -> object:
    needs_hf = name.startswith("hf_")
    skip = pytest.mark.skipif(needs_hf and not HAS_TRANSFORMERS, reason="transformers is not installed")
    return pytest.param(name, marks=(skip, *marks), id=name)


NAMES = list(zoo.MODELS)
_built: dict[str, zoo.ZooModel] = {}


def model(name: str) -> zoo.ZooModel:
    """One build per model for the whole module: runners come and go over it (as an engine's would)."""
    if name not in _built:
        _built[name] = zoo.build(name, zoo.CPU_TINY)
    return _built[name]


def check(name: str, **mode: object) -> None:
    built = model(name)
    runner = GraphRunner(built.forward, device="cpu", sizes=SIZES, **built.runner_kwargs(), **mode)
    try:
        runner.capture()
        for n, seed in ((3, 1), (1, 2), (4, 3)):
            result = runner.verify(**built.make_step(n, seed))
            assert result.replayed, f"{name}: {n} rows did not replay"
            assert result.max_abs_diff == 0, f"{name}: graph differs from the same code run eagerly: {result}"
            assert result.ok, f"{name}: graph differs from eager on the caller's rows: {result}"
    finally:
        runner.close()


@pytest.mark.parametrize("name", [_param(n) for n in NAMES])
@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_zoo_model_equals_eager(name, mode):
    check(name, mode=mode)


@pytest.mark.slow
@pytest.mark.parametrize("name", [_param(n) for n in NAMES])
def test_zoo_model_under_tc_piecewise(name):
    check(name, mode="tc_piecewise")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        _param(n)
        if n == "plain" or INDUCTOR_ALL
        else _param(
            n, pytest.mark.skip(reason="inductor on the CPU takes minutes per model: DEVGRAPH_INDUCTOR_ALL=1")
        )
        for n in NAMES
    ],
)
def test_zoo_model_under_compiled_full(name):
    phase = model(name).phase
    check(name, config=f'{{"{phase}": {{"backend": "full", "compiler": "inductor"}}}}')


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_mixtral_with_its_default_experts_loop_is_refused_naming_the_host_sync(mode):
    from zoo.hf import build_hf

    built = build_hf("mixtral", zoo.CPU_TINY, "cpu", torch.float32, experts="eager")
    runner = GraphRunner(built.forward, device="cpu", sizes=SIZES, **built.runner_kwargs(), mode=mode)
    with pytest.raises(CaptureError) as caught:
        runner.capture()
    assert caught.value.cause == "host_sync"
    assert "nonzero" in str(caught.value) or "syncs with the host" in str(caught.value)
    step = built.make_step(2, 0)
    with torch.no_grad():
        torch.testing.assert_close(runner.run(**step), built.forward(**step))  # still serves, eagerly
