"""devgraph-npu: detection without torch-npu, the seam's errors, and NPU graphs through the fake torch_npu.

Real Ascend hardware runs these only through the ``npu`` marker tests at the end; everything else
uses ``fakes_npu`` (a fake torch_npu whose NPUGraph records through the CPU simulator).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import dataclass

import fakes_npu
import pytest
import torch
from fakes_common import ROOT, ensure_plugins_importable, plugin_registry

import devgraph
from devgraph import CaptureError, ConfigError, GraphKey, GraphRunner, StaticInput
from devgraph.cli.info import collect_info
from devgraph.errors import BackendUnavailableError, DevGraphError
from devgraph.flag.factory import auto_mode

ensure_plugins_importable()

from devgraph_npu import _torch_npu  # noqa: E402
from devgraph_npu import plugin as npu_plugin  # noqa: E402
from devgraph_npu.backends import NpuFullGraphBackend  # noqa: E402
from devgraph_npu.platform import NpuPlatform, translate_ascend_error  # noqa: E402

SLOTS, SEQ, HEADS, DIM = 8, 16, 2, 8


@pytest.fixture
def no_torch_npu(monkeypatch):
    """torch_npu absent, whatever this machine has."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    _torch_npu.reset()
    yield
    _torch_npu.reset()


@pytest.fixture
def fake(monkeypatch):
    with fakes_npu.install(monkeypatch) as state:
        yield state


@pytest.fixture
def registry():
    return plugin_registry(npu_plugin)


# -- detection and the seam ----------------------------------------------------------------------------
def test_unusable_without_torch_npu_and_says_why(no_torch_npu, registry):
    info = collect_info(registry)
    npu = next(p for p in info["platforms"] if p["name"] == "npu")
    assert not npu["usable"]
    assert "torch-npu is not installed" in npu["reason"] and "devgraph-npu[ascend]" in npu["reason"]
    backend = next(b for b in info["backends"] if (b["platform"], b["name"]) == ("npu", "full"))
    assert not backend["usable"] and backend["default_for"] == ["decode", "verify"]
    assert auto_mode("npu", "verify", registry) == ("full", None)  # verify is like decode
    assert "torch_npu" not in [m for m, v in sys.modules.items() if v is not None]
    with pytest.raises(_torch_npu.TorchNpuUnavailable, match="not installed") as err:
        _torch_npu.load()
    assert isinstance(err.value, BackendUnavailableError)


def test_plugin_load_does_not_import_torch_npu(monkeypatch):
    lookups = []

    class Spy:
        def find_spec(self, name, path=None, target=None):
            if name == "torch_npu":
                lookups.append(name)
            return None

    monkeypatch.setattr(sys, "meta_path", [Spy(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    _torch_npu.reset()
    plugin_registry(npu_plugin)
    assert lookups == []  # registering touches nothing; only availability() looks for torch_npu
    NpuPlatform().availability()
    assert lookups == ["torch_npu"]


def test_import_failure_names_cann_and_autoload(tmp_path, monkeypatch):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    _torch_npu.reset()
    try:
        availability = NpuPlatform().availability()
        assert not availability
        for needle in ("libhccl.so", "CANN", "set_env.sh", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
            assert needle in availability.reason
        with pytest.raises(DevGraphError, match="TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
            _torch_npu.load()
    finally:
        _torch_npu.reset()


def test_devgraph_info_cli_lists_npu_unusable():
    names = {ep.name for ep in importlib.metadata.entry_points(group="devgraph")}
    if "npu" not in names:
        pytest.skip("devgraph-npu is not installed (make setup installs it with pip install -e backends/npu)")
    out = subprocess.run(
        [sys.executable, "-m", "devgraph", "info"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.strip().startswith("npu:full"))
    assert "unusable:" in line
    info = json.loads(
        subprocess.run(
            [sys.executable, "-m", "devgraph", "info", "--json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            check=True,
        ).stdout
    )
    npu = next(p for p in info["platforms"] if p["name"] == "npu")
    if importlib.util.find_spec("torch_npu") is None:
        assert not npu["usable"] and "torch-npu is not installed" in npu["reason"]


@pytest.mark.parametrize(
    "text",
    [
        fakes_npu.STREAM_EXHAUSTION_TEXT,
        "rtStreamWaitEvent execution failed, reason=driver error:resource alloc fail\nstream wait event "
        "failed, runtime result = 207005",
    ],
)
def test_stream_exhaustion_texts_become_capture_errors_with_the_fix(text):
    error = translate_ascend_error(RuntimeError(text), 48)
    assert isinstance(error, CaptureError) and error.size == 48
    message = str(error)
    assert "size 48" in message and "fewer sizes" in message and "driver" in message
    assert ("207008" in message) == ("207008" in text)


def test_unknown_errors_are_not_translated():
    assert translate_ascend_error(RuntimeError("shape mismatch in matmul"), 4) is None


# -- graphs through the fake ---------------------------------------------------------------------------
def test_fake_platform_usable_and_described(fake, registry):
    platform = registry.platform("npu")
    assert platform.availability()
    assert "Ascend910B3" in platform.describe() and "torch-npu 2.6.0" in platform.describe()
    assert platform.supports_host_update()


@dataclass
class Lens:
    """The forward context: host-side lengths for steps that run eagerly at capture."""

    seq_lens: list[int]


class AttentionModel:
    """Decode attention whose kernel takes the sequence lengths as a host-side list, like Ascend's."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.wq = torch.randn(HEADS * DIM, HEADS * DIM, generator=gen) / math.sqrt(HEADS * DIM)
        self.k_cache = torch.randn(SLOTS + 1, SEQ, HEADS, DIM, generator=gen)
        self.v_cache = torch.randn(SLOTS + 1, SEQ, HEADS, DIM, generator=gen)

    def __call__(
        self, x: torch.Tensor, req_slots: torch.Tensor, actual_seq_lengths_kv: torch.Tensor
    ) -> torch.Tensor:
        import torch_npu

        if devgraph.is_capturing():
            # The simulator counts .tolist() as a device sync (all its tensors are "device" tensors); an
            # engine on a real NPU reads its CPU copy here. Capture-time lengths come from the context.
            lens = list(devgraph.get_forward_context().seq_lens)
        else:
            lens = actual_seq_lengths_kv.tolist()
        q = (x @ self.wq).view(-1, HEADS, DIM)
        keys = self.k_cache.index_select(0, req_slots)
        values = self.v_cache.index_select(0, req_slots)
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q, keys, values, actual_seq_lengths_kv=lens, num_heads=HEADS, scale=DIM**-0.5
        )
        return out.reshape(-1, HEADS * DIM)


def _inputs() -> dict[str, StaticInput]:
    return {
        "x": StaticInput(torch.float32, (HEADS * DIM,)),
        "req_slots": StaticInput(torch.int64, fill=SLOTS),  # padding rows read the scratch slot
        # Host-side, named after the op keyword NPUGraph.update re-issues (or map it with host_update=).
        "actual_seq_lengths_kv": StaticInput(torch.int64, fill=0, host=True),
    }


def _runner(registry, model, **options):
    platform = registry.platform("npu")
    backend = NpuFullGraphBackend(platform, phase="decode", options=devgraph.BackendOptions(extra=options))
    return GraphRunner(
        model,
        phase="decode",
        inputs=_inputs(),
        sizes=[2, 4],
        backend=backend,
        progress=False,
        capture_context=lambda key: Lens([SEQ] * key.tokens),
    )


def _step(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEADS * DIM, generator=gen)
    slots = torch.randperm(SLOTS, generator=gen)[:n]
    lens = torch.randint(1, SEQ, (n,), generator=gen)
    return {"x": x, "req_slots": slots, "actual_seq_lengths_kv": lens}


def test_host_update_reissues_attention_with_live_lengths(fake, registry):
    model = AttentionModel()
    runner = _runner(registry, model)
    runner.capture()
    graph = runner.backend._entries[GraphKey.of(4)].graph
    assert graph.auto_dispatch_capture and len(graph.graph_dispatch_mode.graph_dispatch_records) == 1
    for seed in range(3):
        step = _step(3, seed)
        out = runner.run(**step)
        want = model(**step)  # eager, unpadded, live lengths
        torch.testing.assert_close(out, want)
        record = graph.graph_dispatch_mode.graph_dispatch_records[0]
        assert record.kwargs["actual_seq_lengths_kv"] == step["actual_seq_lengths_kv"].tolist() + [
            0
        ]  # padding row: the fill
    assert fake.updates == 3 and runner.verify(**_step(4, 9)).ok
    runner.close()
    assert fake.live_graphs == 0


def test_without_update_the_replay_keeps_capture_time_lengths(fake, registry):
    model = AttentionModel()
    runner = _runner(registry, model, host_update={})
    runner.capture()
    step = _step(4, 5)
    out = runner.run(**step).clone()
    stale = model(**{**step, "actual_seq_lengths_kv": torch.full((4,), SEQ)})
    torch.testing.assert_close(out, stale)  # what the device does without NPUGraph.update
    assert (out - model(**step)).abs().max() > 1e-3
    assert fake.updates == 0
    result = runner.verify(**step)
    assert not result.ok  # verify() against eager catches the stale lengths
    runner.close()


def test_host_update_names_op_keyword(fake, registry):
    model = AttentionModel()

    def forward(x, req_slots, lens_cpu):
        return model(x, req_slots, lens_cpu)

    inputs = _inputs()
    inputs["lens_cpu"] = inputs.pop("actual_seq_lengths_kv")
    platform = registry.platform("npu")
    backend = NpuFullGraphBackend(
        platform,
        phase="decode",
        options=devgraph.BackendOptions(extra={"host_update": {"lens_cpu": "actual_seq_lengths_kv"}}),
    )
    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=inputs,
        sizes=[2, 4],
        backend=backend,
        progress=False,
        capture_context=lambda key: Lens([SEQ] * key.tokens),
    )
    runner.capture()
    step = _step(2, 3)
    out = runner.run(x=step["x"], req_slots=step["req_slots"], lens_cpu=step["actual_seq_lengths_kv"])
    torch.testing.assert_close(out, model(**step))
    assert backend.host_updates == {"lens_cpu": "actual_seq_lengths_kv"}
    runner.close()


def test_host_update_must_name_host_inputs(fake, registry):
    runner = _runner(registry, AttentionModel(), host_update={"x": "actual_seq_lengths_kv"})
    with pytest.raises(ConfigError, match="not host-side inputs"):
        runner.capture()


def test_stream_exhaustion_fails_capture_with_the_fix_and_releases(monkeypatch, registry):
    with fakes_npu.install(monkeypatch, stream_budget=2) as state:
        model = AttentionModel()
        platform = registry.platform("npu")
        runner = GraphRunner(
            model,
            phase="decode",
            inputs=_inputs(),
            sizes=[1, 2, 4],
            backend=NpuFullGraphBackend(platform, phase="decode"),
            progress=False,
            capture_context=lambda key: Lens([SEQ] * key.tokens),
        )
        with pytest.raises(CaptureError) as err:
            runner.capture()
        assert err.value.size == 1  # largest first: 4 and 2 fit, 1 does not
        message = str(err.value)
        assert (
            "size 1" in message and "207008" in message and "fewer sizes" in message and "driver" in message
        )
        assert state.live_graphs == 0  # graphs captured before the failure were released


def test_fake_models_the_update_contract(fake):
    import torch_npu

    npu = torch_npu.npu
    q, k, v = torch.randn(2, HEADS, DIM), torch.randn(2, SEQ, HEADS, DIM), torch.randn(2, SEQ, HEADS, DIM)
    graph = npu.NPUGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        graph.capture_begin()
    stream = npu.Stream()
    with npu.graph(graph, stream=stream):  # no auto_dispatch_capture
        out, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[3, 4])
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [5, 6]}])
    graph.reset()
    with npu.graph(graph, pool=npu.graph_pool_handle(), stream=stream, auto_dispatch_capture=True):
        out, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[3, 4])
        out2, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[3, 4])
    assert len(graph.graph_dispatch_mode.graph_dispatch_records) == 2
    with pytest.raises(RuntimeError, match="there are 2 operators"):
        graph.update(cpu_update_input=[{}, {}, {}])
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [9, 1], "unknown_key": 1}])  # one dict: every op
    graph.replay()
    want, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[9, 1])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out2, want)
    assert "unknown_key" not in graph.graph_dispatch_mode.graph_dispatch_records[0].kwargs
    graph.reset()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        graph.replay()


def test_conformance_kit_passes_through_the_fake(fake, registry):
    from devgraph.testing import run_conformance

    report = run_conformance("npu:full", registry=registry)
    report.raise_for_failures()
    assert {r.check for r in report.results if r.status == "passed"} >= {"static_addresses", "capture_errors"}


@pytest.mark.npu
def test_conformance_kit_on_an_ascend_npu():
    from devgraph.testing import run_conformance

    run_conformance("npu:full").raise_for_failures()
