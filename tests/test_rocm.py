"""devgraph-rocm: detection, defaults, the refused breakable, warm-up on the capture stream, and HIP graphs
through a fake ROCm build of torch (``fakes_rocm``). Real AMD hardware runs the ``rocm`` marker tests; the
``cuda`` marker test runs the HIP backend classes on an NVIDIA GPU through ``DEVGRAPH_ROCM_ON_CUDA=1``.
"""

from __future__ import annotations

import fakes_rocm
import pytest
import torch
from fakes_common import Mlp, ensure_plugins_importable, plugin_registry

from devgraph import CaptureError, DeviceGraphConfig, GraphKey, GraphRunner, StaticInput, create_backend
from devgraph.cli.info import collect_info
from devgraph.errors import BackendUnavailableError
from devgraph.flag.factory import resolve_phase

ensure_plugins_importable()

from devgraph_rocm import plugin as rocm_plugin  # noqa: E402
from devgraph_rocm.backends import (  # noqa: E402
    BREAKABLE_REFUSED,
    RocmBreakableBackend,
    RocmFullGraphBackend,
    RocmTcPiecewiseBackend,
)
from devgraph_rocm.platform import ROCM_ON_CUDA_ENV, RocmPlatform  # noqa: E402


@pytest.fixture
def registry():
    return plugin_registry(rocm_plugin)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv(ROCM_ON_CUDA_ENV, raising=False)
    with fakes_rocm.install(monkeypatch) as state:
        yield state


def _not_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(ROCM_ON_CUDA_ENV, raising=False)


# -- detection and registration ------------------------------------------------------------------------
def test_unusable_on_a_build_without_hip(monkeypatch, registry):
    _not_rocm(monkeypatch)
    info = collect_info(registry)
    rocm = next(p for p in info["platforms"] if p["name"] == "rocm")
    assert not rocm["usable"] and "not a ROCm build" in rocm["reason"] and "rocm" in rocm["reason"]
    backends = {b["name"]: b for b in info["backends"] if b["platform"] == "rocm"}
    assert backends["full"]["default_for"] == ["decode", "verify"]  # verify is like decode (PhaseSpec.like)
    assert backends["tc_piecewise"]["default_for"] == ["encode", "prefill"]
    assert backends["breakable"]["default_for"] == [] and not backends["breakable"]["usable"]
    assert backends["breakable"]["reason"] == BREAKABLE_REFUSED
    assert not RocmPlatform().matches(torch.device("cuda"))


def test_breakable_is_refused_with_the_reason_everywhere(fake, registry):
    assert "tc_piecewise" in BREAKABLE_REFUSED and "rocm-no-breakable" in BREAKABLE_REFUSED
    with pytest.raises(BackendUnavailableError, match="refused on ROCm"):
        create_backend("cuda", "prefill", "breakable", registry=registry)
    with pytest.raises(BackendUnavailableError, match="refused on ROCm"):
        RocmBreakableBackend(registry.platform("rocm"), phase="prefill")


def test_rule_downgrades_breakable_configs_on_rocm(registry):
    config = DeviceGraphConfig.parse("decode=full,prefill=breakable")
    resolved = resolve_phase(config, "prefill", "rocm", registry=registry)
    assert resolved.backend == "tc_piecewise"
    assert [d.rule for d in resolved.downgrades] == ["rocm-no-breakable"]
    # The rule is the ROCm plug-in's policy: other platforms keep breakable, and decode is untouched.
    assert resolve_phase(config, "prefill", "cpu", registry=registry).backend == "breakable"
    assert resolve_phase(config, "decode", "rocm", registry=registry).backend == "full"


def test_fake_rocm_build_is_detected_and_defaults_apply(fake, registry):
    platform = registry.platform("rocm")
    assert platform.availability()
    assert "MI300X" in platform.describe() and fakes_rocm.HIP_VERSION in platform.describe()
    assert platform.matches(torch.device("cuda", 0))
    assert isinstance(create_backend("cuda", "decode", registry=registry), RocmFullGraphBackend)
    assert isinstance(create_backend("cuda", "prefill", registry=registry), RocmTcPiecewiseBackend)
    assert isinstance(create_backend("cuda", "encode", registry=registry), RocmTcPiecewiseBackend)


def test_cuda_platform_steps_aside_on_rocm(fake):
    cuda = pytest.importorskip("devgraph_cuda.platform")
    assert not cuda.CudaPlatform().availability()
    assert not cuda.CudaPlatform().matches(torch.device("cuda"))


def test_rocm_on_cuda_test_hook(monkeypatch):
    _not_rocm(monkeypatch)
    monkeypatch.setenv(ROCM_ON_CUDA_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    platform = RocmPlatform()
    assert not platform.availability() and "no CUDA GPU" in platform.availability().reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.availability() and ROCM_ON_CUDA_ENV in platform.availability().reason
    assert platform.matches(torch.device("cuda", 0))
    monkeypatch.setenv(ROCM_ON_CUDA_ENV, "0")
    assert not platform.availability() and not platform.matches(torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (fakes_rocm.HIPBLASLT_CAPTURE_TEXT, "hipBLASLt creates its handles lazily"),
        (
            "HIP error: hipErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
            "synchronized with the host",
        ),
    ],
)
def test_hip_capture_errors_are_translated(text, needle):
    error = RocmPlatform().translate_capture_error(RuntimeError(text), 16)
    assert isinstance(error, CaptureError) and error.size == 16 and needle in str(error)


# -- HIP graphs through the fake -----------------------------------------------------------------------
def _runner(registry, **kwargs):
    backend = RocmFullGraphBackend(registry.platform("rocm"), phase="decode")
    return GraphRunner(
        Mlp(),
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (8,))},
        sizes=[2, 4],
        backend=backend,
        progress=False,
        **kwargs,
    )


def test_warmup_runs_on_the_capture_stream(fake, registry):
    gemms = []
    original = fake.gemm_on

    def spy(stream):
        from devgraph.platforms.sim import graph as sim

        gemms.append((stream.stream_id, sim.is_capturing()))
        original(stream)

    fake.gemm_on = spy
    runner = _runner(registry)
    runner.capture()
    captured_on = {sid for sid, capturing in gemms if capturing}
    warmed_on = {sid for sid, capturing in gemms if not capturing}
    assert captured_on and captured_on <= warmed_on  # every capturing stream saw GEMMs before its capture
    assert captured_on <= fake.blas_handles
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner.run(x=x), runner.forward(x))
    runner.close()


def test_capture_without_warmup_fails_like_hipblaslt(fake, registry):
    runner = _runner(registry, warmup_iters=0)
    with pytest.raises(CaptureError) as err:
        runner.capture()
    assert err.value.size == 4 and "hipBLASLt" in str(err.value) and "warm" in str(err.value)
    assert fake.live_graphs == 0


def test_capture_on_another_stream_than_the_session_is_refused(fake, registry):
    platform = registry.platform("rocm")
    backend = RocmFullGraphBackend(platform, phase="decode")
    x = torch.randn(2, 8)
    with (
        backend.capture_session(platform.new_stream()),
        platform.stream(torch.cuda.Stream()),
        pytest.raises(CaptureError, match="capture stream"),
    ):
        backend.capture_one(GraphKey.of(2), lambda: Mlp()(x))
    assert not backend.has_shape(GraphKey.of(2))


def test_fake_models_the_cuda_graph_contract(fake):
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        graph.capture_begin()
    with pytest.raises(RuntimeError, match="capture_error_mode"):
        graph.capture_begin(capture_error_mode="strict")
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        graph.replay()
    x = torch.ones(2, 2)
    with torch.cuda.stream(torch.cuda.Stream()):
        x @ x  # warm up: creates the stream's hipBLASLt handle
        graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
        y = x @ x
        graph.capture_end()
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(y, torch.full((2, 2), 8.0))
    with (
        torch.cuda.stream(torch.cuda.Stream()),
        pytest.raises(RuntimeError, match="unknown graph memory pool"),
    ):
        torch.cuda.CUDAGraph().capture_begin(pool=(0, 999_999))
    graph.reset()


# -- hardware ------------------------------------------------------------------------------------------
@pytest.mark.rocm
@pytest.mark.parametrize("target", ["rocm:full", "rocm:tc_piecewise"])
def test_conformance_kit_on_an_amd_gpu(target):
    from devgraph.testing import run_conformance

    run_conformance(target).raise_for_failures()


@pytest.mark.cuda
@pytest.mark.parametrize("target", ["rocm:full", "rocm:tc_piecewise"])
def test_hip_backend_classes_on_an_nvidia_gpu(target, monkeypatch):
    """torch's graph API is the same on both builds: the HIP backends pass the kit on an NVIDIA GPU."""
    from devgraph.testing import run_conformance

    monkeypatch.setenv(ROCM_ON_CUDA_ENV, "1")
    run_conformance(target, registry=plugin_registry(rocm_plugin)).raise_for_failures()
