"""The vendor-neutral ``accelerator`` platform on ``torch.accelerator.Graph``: its refusals (the torch version
and the missing piece named), how a device gets it (``DEVGRAPH_PLATFORM``; a priority below every vendor
plug-in), the conformance kit through a fake of the API (``fakes_accelerator``; no GPU here has a torch with
it), and the ``cuda`` tests that run it through the real API where the GPU's torch has one."""

from __future__ import annotations

import re

import fakes_accelerator
import pytest
import torch
from fakes_common import Mlp, ensure_plugins_importable, plugin_registry

from devgraph import CaptureError, DeviceGraphConfig, GraphRunner, StaticInput, create_backend
from devgraph.errors import BackendUnavailableError, ConfigError
from devgraph.flag.factory import PLATFORM_ENV, best_platform, resolve_phase, resolve_platform
from devgraph.platforms.accelerator import (
    GRAPH_RELEASE,
    AcceleratorGraphPlatform,
    AcceleratorPool,
    missing_api,
)
from devgraph.registry.plugins import Registry
from devgraph.strategies import BreakableBackend, FullGraphBackend
from devgraph.testing import run_check, run_conformance

ensure_plugins_importable()

from devgraph_cuda import plugin as cuda_plugin  # noqa: E402


@pytest.fixture
def builtin() -> Registry:
    """The built-in plug-in alone: the cpu and accelerator platforms, no vendor plug-in."""
    return Registry(entry_points=False).load()


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv(PLATFORM_ENV, raising=False)
    with fakes_accelerator.install(monkeypatch) as state:
        yield state


def _runner(backend, **kwargs) -> GraphRunner:
    return GraphRunner(
        Mlp(),
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (8,))},
        sizes=[1, 2, 4],
        backend=backend,
        progress=False,
        **kwargs,
    )


# -- refusals: the torch version and the missing piece ------------------------------------------------
def test_a_torch_without_accelerator_graph_is_refused_with_its_version(monkeypatch, builtin):
    with fakes_accelerator.install(monkeypatch, graph=False):
        reason = AcceleratorGraphPlatform().availability().reason
        assert not AcceleratorGraphPlatform().availability()
        assert f"torch {torch.__version__} has no torch.accelerator.Graph" in reason
        assert f"torch {GRAPH_RELEASE}" in reason and "devgraph-cuda" in reason
        with pytest.raises(BackendUnavailableError, match=re.escape(reason)):
            run_conformance("accelerator:full", registry=builtin)


def test_this_torch_is_judged_by_feature(builtin):
    """Whatever torch runs the suite (2.13 on the CPU in CI, 2.11 on the GPU image), the answer follows
    what it has: missing calls are named with the version, else the missing accelerator or device."""
    availability = AcceleratorGraphPlatform().availability()
    missing = missing_api()
    if missing:
        assert not availability and torch.__version__ in availability.reason
        assert all(name in availability.reason for name in missing)
    elif torch.accelerator.current_accelerator() is None:
        assert not availability and "has no accelerator" in availability.reason
    if not availability:
        with pytest.raises(BackendUnavailableError, match="cannot run here"):
            run_conformance("accelerator:full", registry=builtin)
        assert not builtin.platform("accelerator").matches(torch.device("cpu"))


def test_a_device_type_without_graph_support_is_refused(monkeypatch):
    with fakes_accelerator.install(monkeypatch, device_type="mps"):

        class NoGraphs:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("Graph is not supported on mps")

        monkeypatch.setattr(torch.accelerator, "Graph", NoGraphs)
        availability = AcceleratorGraphPlatform().availability()
    assert not availability
    assert "no graph support for mps" in availability.reason and "not supported on mps" in availability.reason


def test_no_visible_device_is_refused(monkeypatch):
    with fakes_accelerator.install(monkeypatch, device_type="xpu"):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
        availability = AcceleratorGraphPlatform().availability()
    assert not availability and "sees no xpu device" in availability.reason


# -- which platform a device gets ---------------------------------------------------------------------
def test_vendor_plugins_keep_their_devices_unless_the_user_names_accelerator(monkeypatch):
    with fakes_accelerator.install(monkeypatch, device_type="cuda"):
        registry = plugin_registry(cuda_plugin)
        monkeypatch.delenv(PLATFORM_ENV, raising=False)
        assert resolve_platform("cuda:0", registry).name == "cuda"
        monkeypatch.setenv(PLATFORM_ENV, "accelerator")
        assert resolve_platform("cuda:0", registry).name == "accelerator"
        backend = create_backend("cuda:0", "decode", registry=registry)
        assert backend.platform.name == "accelerator" and isinstance(backend, FullGraphBackend)
        # A device the named platform does not handle resolves as before.
        assert resolve_platform("cpu", registry).name == "cpu"
        assert best_platform(registry).name == "accelerator"


def test_a_device_no_vendor_plugin_claims_gets_the_accelerator_platform(monkeypatch, builtin):
    monkeypatch.delenv(PLATFORM_ENV, raising=False)
    with fakes_accelerator.install(monkeypatch, device_type="xpu"):
        assert resolve_platform("xpu", builtin).name == "accelerator"
        assert best_platform(builtin).name == "accelerator"
    # Without an accelerator (this CPU build), the CPU simulator stays the best platform.
    assert AcceleratorGraphPlatform.priority > builtin.platforms["cpu"].cls.priority
    if not AcceleratorGraphPlatform().availability():
        assert best_platform(builtin).name == "cpu"


def test_a_named_platform_that_is_unknown_or_unusable_is_an_error(monkeypatch, builtin):
    monkeypatch.setenv(PLATFORM_ENV, "acelerator")
    with pytest.raises(ConfigError, match="names no registered platform .*accelerator, cpu"):
        resolve_platform("cpu", builtin)
    with fakes_accelerator.install(monkeypatch, graph=False):
        monkeypatch.setenv(PLATFORM_ENV, "accelerator")
        with pytest.raises(BackendUnavailableError, match="DEVGRAPH_PLATFORM=accelerator: .*unusable here"):
            best_platform(builtin)


def test_auto_picks_the_same_defaults_as_the_cuda_plugin(builtin):
    config = DeviceGraphConfig.parse("auto")
    phases = ("decode", "prefill", "encode", "verify")
    chosen = {p: resolve_phase(config, p, "accelerator", registry=builtin).backend for p in phases}
    assert chosen == {"decode": "full", "prefill": "breakable", "encode": "breakable", "verify": "full"}
    with_cuda = plugin_registry(cuda_plugin)
    assert chosen == {p: resolve_phase(config, p, "cuda", registry=with_cuda).backend for p in phases}


# -- the platform through the fake --------------------------------------------------------------------
@pytest.mark.parametrize("target", ["accelerator:full", "accelerator:breakable"])
def test_conformance_kit_through_the_fake(target, fake, builtin):
    report = run_conformance(target, registry=builtin)
    report.raise_for_failures()
    # The fake captures through the CPU simulator, which detects host syncs: nothing may be skipped.
    assert all(r.status == "passed" for r in report.results), report.table()
    assert set(fake.modes) == {"thread_local"} and fake.live_graphs == 0


@pytest.mark.parametrize("check", ["static_addresses", "break_ops", "failed_capture", "capture_errors"])
def test_tc_piecewise_through_the_fake(check, fake, builtin):
    result = run_check("accelerator:tc_piecewise", check, registry=builtin)
    assert result.status == "passed", f"{check}: {result.status}: {result.detail}"


@pytest.mark.parametrize(
    ("form", "pool_handles"), [("constructor", False), ("capture_begin", False), ("constructor", True)]
)
def test_every_form_of_the_api_shares_one_pool_per_runner(form, pool_handles, monkeypatch, builtin):
    with fakes_accelerator.install(monkeypatch, form=form, pool_handles=pool_handles) as state:
        backend = FullGraphBackend(builtin.platform("accelerator"), phase="decode")
        runner = _runner(backend)
        runner.capture()
        ids = set(state.pool_ids)
        x = torch.randn(3, 8)
        torch.testing.assert_close(runner.run(x=x), runner.forward(x))
        runner.close()
    assert len(ids) == 1 and state.modes == ["thread_local"] * 3
    (pool_id,) = ids
    # torch's ids: (n, 0) when the first capture made the pool, (0, n) from generate_graph_pool_handle.
    assert (pool_id[1] != 0) == pool_handles and state.live_graphs == 0


def test_a_failed_first_capture_leaves_the_pool_to_the_next(fake, builtin):
    platform = builtin.platform("accelerator")
    pool = platform.graph_pool_handle()
    assert isinstance(pool, AcceleratorPool) and pool.handle is None
    x = torch.ones(2, 2)
    with platform.stream(platform.new_stream()):
        graph = platform.new_graph()
        platform.capture_begin(graph, pool)
        platform.abort_capture(graph)
        assert pool.handle is None and fake.live_graphs == 0
        graph = platform.new_graph()
        platform.capture_begin(graph, pool)
        y = x * 2
        platform.capture_end(graph)
    assert pool.handle == graph.pool()
    x.fill_(3.0)
    graph.replay()
    assert torch.equal(y, torch.full((2, 2), 6.0))


def test_a_named_accelerator_runs_an_ordinary_runner(fake, monkeypatch):
    monkeypatch.setenv(PLATFORM_ENV, "accelerator")
    runner = GraphRunner(
        Mlp(), phase="decode", inputs={"x": StaticInput(torch.float32, (8,))}, sizes=[2, 4], progress=False
    )
    assert runner.platform.name == "accelerator" and isinstance(runner.backend, FullGraphBackend)
    runner.capture()
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner.run(x=x), runner.forward(x))
    assert fake.replays >= 1
    prefill = create_backend(None, "prefill")
    assert prefill.platform.name == "accelerator" and isinstance(prefill, BreakableBackend)
    runner.close()


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: operation not permitted when stream is capturing",
        "cudaErrorStreamCaptureUnsupported: operation not permitted",
        "hipErrorStreamCaptureInvalidated",
        "Synchronize during XPU graph capture. If you need this call to be captured, please file an issue.",
    ],
)
def test_host_syncs_the_devices_report_become_capture_errors(text):
    error = AcceleratorGraphPlatform().translate_capture_error(RuntimeError(text), 8)
    assert isinstance(error, CaptureError) and error.size == 8 and "synchronized with the host" in str(error)


def test_other_device_errors_are_left_alone():
    assert AcceleratorGraphPlatform().translate_capture_error(RuntimeError("out of memory"), 8) is None


def test_fake_models_the_graph_contract(fake):
    graph = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        graph.capture_begin()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        graph.pool()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        graph.replay()
    with pytest.raises(RuntimeError, match="capture_error_mode"):
        torch.accelerator.Graph(capture_error_mode="strict").capture_begin()
    stream = torch.Stream()
    torch.accelerator.set_stream(stream)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        torch.accelerator.Graph(pool=AcceleratorPool((1, 0))).capture_begin()  # the id, not the holder
    x = torch.ones(2)
    kept = torch.accelerator.Graph(keep_graph=True)
    kept.capture_begin()
    y = x + 1
    torch.accelerator.set_stream(torch.Stream())
    with pytest.raises(RuntimeError, match="same stream it began on"):
        kept.capture_end()
    torch.accelerator.set_stream(stream)
    kept.capture_end()
    assert fake.instantiations == 0  # keep_graph: instantiated on the first replay, not at capture_end
    x.fill_(5.0)
    kept.replay()
    assert fake.instantiations == 1 and torch.equal(y, torch.full((2,), 6.0))
    kept.reset()
    torch.accelerator.set_stream(fake.streams.default)
    assert fake.live_graphs == 0


# -- a GPU whose torch has the API --------------------------------------------------------------------
def _usable_on_cuda() -> AcceleratorGraphPlatform:
    platform = AcceleratorGraphPlatform()
    availability = platform.availability()
    if not availability:
        pytest.skip(f"accelerator platform unusable on this GPU: {availability.reason}")
    return platform


@pytest.mark.cuda
@pytest.mark.parametrize("target", ["accelerator:full", "accelerator:breakable", "accelerator:tc_piecewise"])
def test_conformance_kit_on_cuda_through_torch_accelerator(target, builtin):
    """CUDA graphs through ``torch.accelerator.Graph`` alone (no devgraph-cuda registered)."""
    _usable_on_cuda()
    report = run_conformance(target, registry=builtin)
    assert report.platform == "accelerator"
    report.raise_for_failures()


@pytest.mark.cuda
def test_accelerator_full_replays_the_reference_model_like_cuda_full():
    from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner, make_decode_batch

    platform = _usable_on_cuda()
    registry = plugin_registry(cuda_plugin)
    model = ReferenceModel(ReferenceConfig.preset("tiny"), device="cuda", seed=0)
    outputs = []
    for backend in (
        create_backend("cuda", "decode", "full", registry=registry),
        FullGraphBackend(platform, phase="decode"),
    ):
        runner = decode_runner(model, sizes=[1, 4, 8], backend=backend, progress=False)
        runner.capture()
        batch = make_decode_batch(model, 3, seq_lens=20, seed=7)
        outputs.append(runner.run(**batch).clone())
        runner.close()
    assert torch.equal(outputs[0], outputs[1])
