"""The zoo (``tests/zoo``) under every strategy on the CPU: each model's graph equals the same code run
eagerly on the same padded inputs (bit for bit: same kernels; a compiled graph against the same compiled
code), and eager on the caller's rows within tolerance; or capture is refused with a message naming the
cause. Never a silent difference.

Cost: ``full`` and ``breakable`` of every model run by default (seconds); ``tc_piecewise`` (dynamo traces
each model) and ``full`` + inductor are marked ``slow`` and run on the hand-written models and Llama
(tc_piecewise) and on the ``plain`` decoder, the pattern compiled ``full`` once failed on (inductor).
``DEVGRAPH_FULL_MATRIX=1`` runs every model under both (about 7 minutes on two cores); the ``cuda`` tests
run every model under every mode on a GPU, and ``benchmarks/bench_zoo.py`` times them.
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
#: The whole matrix (every model under tc_piecewise and compiled full): minutes on two cores, so opt-in.
FULL_MATRIX = os.environ.get("DEVGRAPH_FULL_MATRIX") == "1"
#: What runs by default: the patterns the issue found failing, and one Hugging Face model.
TC_DEFAULT = ("plain", "gptfast", "paged", "hf_llama")


def _batched_experts() -> bool:
    from zoo.hf import batched_experts

    return batched_experts()


def _param(name: str, *marks: pytest.MarkDecorator) -> object:
    needs_hf = name.startswith("hf_")
    skip = pytest.mark.skipif(needs_hf and not HAS_TRANSFORMERS, reason="transformers is not installed")
    if name == "hf_mixtral" and HAS_TRANSFORMERS and not _batched_experts():
        why = "this transformers has no experts_implementation='batched_mm' (its experts loop syncs the host)"
        marks = (*marks, pytest.mark.skip(reason=why))
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


def _opt_in(name: str, default: tuple[str, ...]) -> object:
    if name in default or FULL_MATRIX:
        return _param(name)
    return _param(
        name, pytest.mark.skip(reason="minutes on two cores for the whole zoo: DEVGRAPH_FULL_MATRIX=1")
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", [_opt_in(n, TC_DEFAULT) for n in NAMES])
def test_zoo_model_under_tc_piecewise(name):
    check(name, mode="tc_piecewise")


@pytest.mark.slow
@pytest.mark.parametrize("name", [_opt_in(n, ("plain",)) for n in NAMES])
def test_zoo_model_under_compiled_full(name):
    phase = model(name).phase
    check(name, config=f'{{"{phase}": {{"backend": "full", "compiler": "inductor"}}}}')


#: Qwen3-0.6B's widths, two layers, bf16: the GPU check of every model under every mode (minutes).
CUDA_SHAPE = zoo.QWEN3_06B_LIKE.with_(layers=2, max_batch=8, max_len=128)
CUDA_MODES = {
    "full": "full",
    "breakable": "breakable",
    "tc_piecewise": "tc_piecewise",
    "full_inductor": '{{"{phase}": {{"backend": "full", "compiler": "inductor"}}}}',
}


#: The models compiled with inductor on the GPU: the in-place static cache (plain, gptfast), the paged one,
#: two Hugging Face decoder families and the encoder. The other Hugging Face decoders share their blocks
#: with these and run every other mode on the GPU; an inductor compile each (tens of seconds) would push
#: the CUDA suite past the ten minutes a device call has.
CUDA_COMPILED = ("plain", "gptfast", "paged", "hf_llama", "hf_qwen3", "hf_bert")


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("name", "mode"),
    [
        pytest.param(*_param(n).values, mode, marks=_param(n).marks, id=f"{n}-{mode}")  # type: ignore[attr-defined]
        for n in NAMES
        for mode in CUDA_MODES
        if mode != "full_inductor" or n in CUDA_COMPILED
    ],
)
def test_zoo_model_on_cuda(name, mode):
    # The same checks on an NVIDIA GPU, bf16: nested break ops under breakable (before: "already
    # recording to mempool"), compiled full on the static caches written in place.
    built = zoo.build(name, CUDA_SHAPE, "cuda", torch.bfloat16)
    chosen = CUDA_MODES[mode].format(phase=built.phase)
    kwargs = {"config": chosen} if chosen.startswith("{") else {"mode": chosen}
    runner = GraphRunner(built.forward, device="cuda", sizes=[1, 4, 8], **built.runner_kwargs(), **kwargs)
    try:
        runner.capture()
        for n, seed in ((3, 1), (8, 2)):
            result = runner.verify(**built.make_step(n, seed))
            assert result.replayed and result.max_abs_diff == 0 and result.ok, (name, mode, result)
    finally:
        runner.close()


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
