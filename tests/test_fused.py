"""The decoder's fused elementwise kernels (devgraph.reference.fused): RMSNorm, RMSNorm after a residual
add, the per-head q/k norm with RoPE, SiLU-and-multiply; each a Triton kernel against the torch operations
it replaces.

CPU: under ``TRITON_INTERPRET=1`` in a child process (tiny shapes). In float16 the interpreter rounds as a
GPU does, so the kernels equal the torch form bit for bit; in float32 they may differ in the last bit of
a sum of squares or of ``exp``. A whole tiny model with ``kernels="triton"`` (fused kernels and Triton
attention) against ``kernels="torch"``. GPU (``cuda`` marker): the same in bf16, and the fused model's
decode graph against its own eager step.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch
from devgraph.reference.fused import add_rms_norm, fused_kernels, qk_norm_rope, rms_norm, silu_mul

HAS_TRITON = importlib.util.find_spec("triton") is not None

_SCRIPT = textwrap.dedent(
    """
    import torch
    from devgraph.reference import ReferenceConfig, ReferenceModel, make_prefill_batch
    from devgraph.reference.fused import add_rms_norm, qk_norm_rope, rms_norm, silu_mul

    torch.manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        exact = dtype == torch.float16
        x, r = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
        w = (1 + 0.1 * torch.randn(96)).to(dtype)
        qk = torch.randn(5, 9, 24).to(dtype)[:, :7]  # a strided view, as the layer passes it
        scale = (1 + 0.1 * torch.randn(7, 24)).to(dtype)
        cos, sin = torch.randn(5, 12).to(dtype), torch.randn(5, 12).to(dtype)
        gate_up = torch.randn(5, 2 * 1500).to(dtype)  # wider than one block
        pairs = [
            (rms_norm(x, w, 1e-6, False), rms_norm(x, w, 1e-6, True)),
            *zip(add_rms_norm(x, r, w, 1e-6, False), add_rms_norm(x, r, w, 1e-6, True)),
            (qk_norm_rope(qk, None, cos, sin, 1e-6, False), qk_norm_rope(qk, None, cos, sin, 1e-6, True)),
            (qk_norm_rope(qk, scale, cos, sin, 1e-6, False), qk_norm_rope(qk, scale, cos, sin, 1e-6, True)),
            (silu_mul(gate_up, False), silu_mul(gate_up, True)),
        ]
        for i, (ref, out) in enumerate(pairs):
            assert out.dtype == ref.dtype and out.shape == ref.shape, (i, out.shape, ref.shape)
            if exact and i < 5:  # SiLU's exp is numpy's here, torch's there: the last bit may differ
                assert torch.equal(out, ref), (dtype, i, (out - ref).abs().max())
            else:
                step = 2.0**-10 if exact else 1e-6
                close = (out.float() - ref.float()).abs() <= step * ref.float().abs().clamp_min(1)
                assert close.all(), (dtype, i, (out - ref).abs().max())
    # A whole model: fused kernels and Triton attention against the torch forms, same weights.
    logits = {}
    for kernels in ("torch", "triton"):
        config = ReferenceConfig.preset("tiny", max_requests=4, dtype=torch.float16, qk_norm=True,
                                        qkv_bias=True, tie_embeddings=False, kernels=kernels)
        model = ReferenceModel(config, seed=0)
        assert all(layer.fused == (kernels == "triton") for layer in model.layers)
        logits[kernels] = model.prefill_step(**make_prefill_batch(model, [5, 9], seed=1)).float()
    error = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    assert error < 1e-2, error
    print("fused ok", float(error))
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the fused kernels are Triton)")
def test_fused_kernels_equal_the_torch_forms_under_the_interpreter() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fused ok" in result.stdout


def test_the_cpu_runs_the_torch_forms_and_a_gpu_the_fused_ones() -> None:
    assert not fused_kernels("auto", torch.device("cpu")) and not fused_kernels("torch", torch.device("cuda"))
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert fused_kernels("triton", torch.device("cpu")) == interpreting  # the interpreter runs them there
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=2), seed=0)
    assert not any(layer.fused for layer in model.layers) and not model.norm.fused


# -- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_fused_kernels_on_the_gpu_round_like_torch() -> None:
    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    x, r = torch.randn(33, 1024, device=dev, dtype=dtype), torch.randn(33, 1024, device=dev, dtype=dtype)
    w = (1 + 0.1 * torch.randn(1024, device=dev)).to(dtype)
    qk = torch.randn(33, 32, 128, device=dev, dtype=dtype)[:, :24]
    scale = (1 + 0.1 * torch.randn(24, 128, device=dev)).to(dtype)
    cos, sin = torch.randn(33, 64, device=dev, dtype=dtype), torch.randn(33, 64, device=dev, dtype=dtype)
    gate_up = torch.randn(33, 6144, device=dev, dtype=dtype)
    # Every fused kernel lands within two bf16 steps of torch's form. Not bitwise: on an H100 (torch 2.11,
    # Triton 3.6) the fused rotation differed from torch's by a step at some elements, across a binade edge
    # too, although the kernel rounds each product as torch does (benchmarks/results/h100-cuda-tests*.txt).
    ulp = 2 * 2.0**-7  # two bf16 steps at magnitude 1
    for ref, out in (
        (qk_norm_rope(qk, None, cos, sin, 1e-6, False), qk_norm_rope(qk, None, cos, sin, 1e-6, True)),
        (silu_mul(gate_up, False), silu_mul(gate_up, True)),
        (rms_norm(x, w, 1e-6, False), rms_norm(x, w, 1e-6, True)),
        (add_rms_norm(x, r, w, 1e-6, False)[0], add_rms_norm(x, r, w, 1e-6, True)[0]),
        (qk_norm_rope(qk, scale, cos, sin, 1e-6, False), qk_norm_rope(qk, scale, cos, sin, 1e-6, True)),
    ):
        assert ((out.float() - ref.float()).abs() <= ulp * ref.float().abs().clamp_min(1)).all()
    assert torch.equal(add_rms_norm(x, r, w, 1e-6, True)[1], x + r)


@pytest.mark.cuda
def test_a_fused_model_replays_its_eager_step_exactly() -> None:
    from devgraph.reference import decode_runner

    config = ReferenceConfig.preset("tiny", max_requests=8, dtype=torch.bfloat16, qk_norm=True, qkv_bias=True)
    model = ReferenceModel(config, device="cuda", seed=0)
    assert all(layer.fused for layer in model.layers)
    runner = decode_runner(model, mode="full", sizes=[8])
    runner.capture()
    batch = make_decode_batch(model, 8, seed=3)  # the captured size: the same kernels as eager
    eager = model.decode_step(**batch)
    assert torch.equal(runner.run(**batch), eager)
    twin = ReferenceModel(
        ReferenceConfig.preset(
            "tiny", max_requests=8, dtype=torch.bfloat16, qk_norm=True, qkv_bias=True, kernels="torch"
        ),
        device="cuda",
        seed=0,
    )
    reference = twin.decode_step(**batch).float()
    assert float((eager.float() - reference).norm() / reference.norm()) < 2e-2
    runner.close()


GPU = torch.device("cuda")  # as a device name only: these tests replace the Triton module


class _Builds:
    """A stand-in for the Triton module: records each build and the thread it ran on."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[int, torch.dtype, str]] = []
        self.fail = fail

    def build_silu_mul(self, width: int, dtype: torch.dtype) -> None:
        import threading

        self.calls.append((width, dtype, threading.current_thread().name))
        if self.fail:
            raise RuntimeError("no compiler here")

    def build_linear(self, dtype: torch.dtype, has_bias: bool = False) -> None:  # the projections' kernels
        import threading

        self.calls.append(("linear", dtype, threading.current_thread().name))


def test_triton_is_set_up_once_per_process_on_a_thread_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from devgraph.reference import fused

    builds = _Builds()
    monkeypatch.setattr(fused, "TRITON_SET_UP", {})
    monkeypatch.setattr(fused, "_ops", lambda: builds)
    monkeypatch.setattr(fused, "_linear_ops", lambda: builds)
    thread = fused.set_up_triton("triton", GPU, 3072, torch.bfloat16)
    assert thread is not None
    thread.join(10)
    assert builds.calls == [
        (3072, torch.bfloat16, "devgraph-triton-set-up"),
        ("linear", torch.bfloat16, "devgraph-triton-set-up"),
    ]
    assert isinstance(fused.TRITON_SET_UP["seconds"], float) and "error" not in fused.TRITON_SET_UP
    assert fused.set_up_triton("triton", GPU, 3072, torch.bfloat16) is None  # once per process
    assert len(builds.calls) == 2


def test_a_failed_set_up_is_recorded_and_raises_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from devgraph.reference import fused

    builds = _Builds(fail=True)
    monkeypatch.setattr(fused, "TRITON_SET_UP", {})
    monkeypatch.setattr(fused, "_ops", lambda: builds)
    monkeypatch.setattr(fused, "_linear_ops", lambda: builds)
    thread = fused.set_up_triton("triton", GPU, 64, torch.float16)
    assert thread is not None
    thread.join(10)
    assert "no compiler here" in str(fused.TRITON_SET_UP["error"])


def test_a_model_on_the_cpu_starts_no_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from devgraph.reference import fused

    builds = _Builds()
    monkeypatch.setattr(fused, "TRITON_SET_UP", {})
    monkeypatch.setattr(fused, "_ops", lambda: builds)
    monkeypatch.setattr(fused, "_linear_ops", lambda: builds)
    ReferenceModel(ReferenceConfig.preset("tiny", kernels="auto"), seed=0)
    assert fused.TRITON_SET_UP == {} and builds.calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_on_a_gpu_the_set_up_builds_the_kernel_the_model_launches() -> None:
    from devgraph.reference import fused
    from devgraph.reference.kernels import triton_fused

    thread = fused.set_up_triton("triton", torch.device("cuda"), 96, torch.bfloat16)
    if thread is not None:
        thread.join(120)
    assert "error" not in fused.TRITON_SET_UP, fused.TRITON_SET_UP
    triton_fused.build_silu_mul(96, torch.bfloat16)  # the kernel is there: no error, nothing launched
    from devgraph.reference.kernels import triton_linear

    triton_linear.build_linear(torch.bfloat16)  # the projections' kernels too
    gate_up = torch.randn(3, 192, device="cuda", dtype=torch.bfloat16)
    ref, out = silu_mul(gate_up, False).float(), silu_mul(gate_up, True).float()
    assert ((out - ref).abs() <= 2 * 2.0**-7 * ref.abs().clamp_min(1)).all()  # as the test above judges it
