"""GraphRunner on the CPU simulated graph: replay against eager, padding, verify, fallbacks, ownership of
its backend, configuration and teardown."""

from __future__ import annotations

import gc

import pytest
import torch

from devgraph import BackendUnavailableError, ConfigError, GraphRunner, StaticInput, resolve_platform
from devgraph.strategies import BreakableBackend, FullGraphBackend

SIZES = [1, 2, 4, 8]
INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0), "idx": StaticInput(torch.int64, fill=9)}


class Affine:
    """forward(x, idx) = x @ w + b[idx]; counts its eager calls."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.w = torch.randn(4, 3, generator=gen)
        self.b = torch.randn(10, 3, generator=gen)
        self.calls = 0

    def __call__(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x @ self.w + self.b[idx]


def make_runner(fn=None, **kwargs) -> GraphRunner:
    kwargs.setdefault("mode", "full")
    kwargs.setdefault("sizes", SIZES)
    return GraphRunner(fn or Affine(), phase="decode", inputs=INPUTS, device="cpu", **kwargs)


def batch(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 4, generator=gen), "idx": torch.randint(0, 9, (n,), generator=gen)}


@pytest.mark.parametrize("mode", ["full", "breakable", "tc_piecewise"])
def test_run_matches_eager_at_every_size(mode):
    fn = Affine()
    runner = make_runner(fn, mode=mode)
    runner.capture()
    for n in (1, 3, 5, 8, 11):
        inputs = batch(n, seed=n)
        torch.testing.assert_close(runner.run(**inputs), fn(**inputs))
    stats = runner.stats()
    assert stats["replays"] == 4 and stats["eager_by_reason"]["past_largest"] == 1


def test_replayed_outputs_keep_their_storage_across_runs():
    runner = make_runner()
    runner.capture()
    first = runner.run(**batch(8, seed=1))
    ptr, first_copy = first.data_ptr(), first.clone()
    second = runner.run(**batch(8, seed=2))
    assert second.data_ptr() == ptr
    assert not torch.equal(first_copy, second)


def test_eager_fallback_before_capture_and_past_the_largest_size():
    fn = Affine()
    runner = make_runner(fn)
    inputs = batch(5)
    torch.testing.assert_close(runner.run(**inputs), fn(**inputs))
    runner.capture()
    calls = fn.calls
    big = batch(12)
    torch.testing.assert_close(runner.run(**big), fn(**big))
    assert fn.calls == calls + 2  # the runner's fallback and the reference call above
    assert runner.stats()["eager_by_reason"]["before_capture"] == 1


def test_verify_reports_zero_for_a_correct_runner():
    runner = make_runner()
    runner.capture()
    for n in (1, 3, 8, 20):
        result = runner.verify(**batch(n))
        assert result.max_abs_diff == 0.0 and result.ok
        assert result.replayed == (n <= 8) and result.n == n
        assert result.size == (runner.bucket(n) if n <= 8 else None)
    assert runner.stats()["steps"] == 0  # verify is not counted as a step


def test_verify_catches_a_staging_bug():
    runner = make_runner()
    runner.capture()
    stage = runner._buffers.stage

    def forgetful(counts, key, inputs):  # a broken staging that never copies idx
        stage(counts, key, {**inputs, "idx": runner.static_inputs["idx"][: counts["tokens"]].clone()})

    runner._buffers.stage = forgetful
    runner.run(**batch(4, seed=1))
    result = runner.verify(**batch(4, seed=2))
    assert result.replayed
    # Graph and eager over the same (stale) buffers agree; eager on the caller's inputs does not.
    assert result.max_abs_diff == 0
    assert result.max_abs_diff_unpadded > 0.1
    assert not result.ok


def test_can_run_false_sends_the_step_to_eager():
    class Picky(FullGraphBackend):
        def can_run(self, batch):
            return batch.context != "no-graph"

    fn = Affine()
    runner = make_runner(fn, mode=None, backend=Picky(resolve_platform("cpu"), phase="decode"))
    runner.capture()
    calls = fn.calls
    runner.run(context="no-graph", **batch(4))
    assert fn.calls == calls + 1
    runner.run(context="graph", **batch(4))
    assert fn.calls == calls + 1
    assert runner.stats()["eager_by_reason"]["backend_declined"] == 1


def test_disabled_mode_never_captures():
    fn = Affine()
    runner = make_runner(fn, mode="disabled")
    report = runner.capture()
    assert report.keys == [] and runner.keys == []
    inputs = batch(3)
    torch.testing.assert_close(runner.run(**inputs), fn(**inputs))
    assert runner.stats()["eager_by_reason"]["disabled"] == 1


# -- one backend, one runner ----------------------------------------------------------------------------
def test_a_backend_serves_one_runner_until_it_closes():
    backend = FullGraphBackend(resolve_platform("cpu"), phase="decode")
    first = make_runner(mode=None, backend=backend)
    first.capture()
    with pytest.raises(ConfigError) as info:
        make_runner(mode=None, backend=backend)
    message = str(info.value)
    assert "already belongs to" in message and repr(first) in message and "close()" in message
    # The refused runner left the first one's graphs alone.
    assert [str(k) for k in first.keys] == ["tokens=1", "tokens=2", "tokens=4", "tokens=8"]
    assert first.stats()["steps"] == 0
    first.run(**batch(3))
    assert first.stats()["replays"] == 1
    first.close()
    second = make_runner(mode=None, backend=backend)
    second.capture()
    second.run(**batch(3))
    assert second.stats()["replays"] == 1


def test_a_failed_capture_of_another_runner_cannot_wipe_the_owners_graphs():
    backend = BreakableBackend(resolve_platform("cpu"), phase="decode")
    owner = make_runner(mode=None, backend=backend)
    owner.capture()
    with pytest.raises(ConfigError, match="already belongs to"):
        GraphRunner(
            lambda x, idx: x.sum().item(), phase="decode", inputs=INPUTS, device="cpu", backend=backend
        )
    assert len(owner.keys) == len(SIZES)
    owner.run(**batch(2))
    assert owner.stats()["replays"] == 1


def test_a_backend_of_a_collected_runner_is_free_again():
    import gc

    backend = FullGraphBackend(resolve_platform("cpu"), phase="decode")
    make_runner(mode=None, backend=backend)  # dropped without close()
    gc.collect()
    make_runner(mode=None, backend=backend).capture()


def test_graphs_left_by_a_runner_dropped_without_close_are_released():
    import gc

    backend = FullGraphBackend(resolve_platform("cpu"), phase="decode")
    make_runner(lambda x, idx: x * 2, mode=None, backend=backend).capture()  # dropped without close()
    gc.collect()
    assert backend.captured_keys()  # its graphs are still there
    runner = make_runner(lambda x, idx: x * 3, mode=None, backend=backend)
    runner.capture()
    inputs = batch(3)
    torch.testing.assert_close(runner.run(**inputs), inputs["x"] * 3)
    assert runner.stats()["replays"] == 1


def test_a_compiling_backend_handed_on_runs_the_new_runners_forward():
    from devgraph.strategies import TcPiecewiseBackend

    backend = TcPiecewiseBackend(resolve_platform("cpu"), phase="decode")
    with make_runner(lambda x, idx: x * 2, mode=None, backend=backend) as first:
        first.capture()
    second = make_runner(lambda x, idx: x * 3, mode=None, backend=backend)
    second.capture()
    inputs = batch(2)
    torch.testing.assert_close(second.run(**inputs), inputs["x"] * 3)


# -- configuration --------------------------------------------------------------------------------------
def test_mode_and_config_are_exclusive_and_backend_must_be_a_backend():
    with pytest.raises(ConfigError, match="either mode="):
        make_runner(mode="full", config="auto")
    with pytest.raises(ConfigError, match="backend= must be a DeviceGraphBackend"):
        make_runner(mode=None, backend="full")
    with pytest.raises(ConfigError, match="forward must be callable"):
        GraphRunner(None, phase="decode", inputs=INPUTS, device="cpu")


def test_config_string_sets_backend_and_sizes():
    runner = GraphRunner(
        Affine(),
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        config='{"decode": {"backend": "breakable", "sizes": [2, 6], "max_size": 4}}',
    )
    assert runner.backend.name == "breakable"
    assert runner.sizes == (2, 4)


def test_host_input_lives_on_the_host_and_tuple_outputs_are_cut():
    def forward(x: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x.sum(dim=0)

    runner = GraphRunner(
        forward,
        phase="prefill",
        device="cpu",
        mode="full",
        sizes=[4, 8],
        inputs={"x": StaticInput(torch.float32, (2,)), "lens": StaticInput(torch.int32, host=True)},
    )
    runner.capture()
    assert runner.static_inputs["lens"].device.type == "cpu"
    rows, total = runner.run(3, x=torch.ones(3, 2), lens=torch.ones(3, dtype=torch.int32))
    assert rows.shape == (3, 2) and total.shape == (2,)
    torch.testing.assert_close(total, torch.full((2,), 3.0))  # padding rows filled with 0


# -- teardown -------------------------------------------------------------------------------------------
def test_close_releases_graph_memory_and_works_as_a_context_manager():
    # The simulator counts every live graph of the process: graphs of earlier tests must be collected
    # before the baseline, or their collection during this test would move it.
    gc.collect()
    with make_runner() as runner:
        baseline = runner.platform.reserved_bytes()
        runner.capture()
        assert runner.platform.reserved_bytes() > baseline
    gc.collect()
    assert runner.platform.reserved_bytes() == baseline
    assert runner.backend.captured_keys() == [] and runner.static_inputs == {}
    assert runner.inspect()["captured"] is False and runner.inspect()["keys"] == {}
    runner.close()  # twice is fine
    for call in (runner.capture, lambda: runner.run(**batch(2)), lambda: runner.verify(**batch(2))):
        with pytest.raises(ConfigError, match="closed"):
            call()
    assert "life=closed" in repr(runner)


def test_barrier_between_warmup_and_capture_with_a_process_group(monkeypatch, unused_tcp_port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{unused_tcp_port}", rank=0, world_size=1)
    try:
        calls = []
        real_barrier = dist.barrier
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append(k) or real_barrier(*a, **k))
        runner = make_runner(process_group=dist.group.WORLD)
        runner.capture()
        assert len(calls) == len(SIZES)
        runner.close()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def unused_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_runner_on_npu_without_torch_npu_gives_the_install_hint():
    # The NPU plug-in is installed here, torch-npu is not: the runner says what to install, as `info` does.
    with pytest.raises(BackendUnavailableError, match="pip install 'devgraph-npu\\[ascend\\]'"):
        GraphRunner(lambda x: x, phase="decode", inputs={"x": StaticInput(torch.float32)}, device="npu")
