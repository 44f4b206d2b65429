"""GraphRunner on the CPU simulated graph: capture, padding, copies, fallback, errors, teardown."""

from __future__ import annotations

import gc

import pytest
import torch

from devgraph import (
    CaptureError,
    ConfigError,
    GraphRunner,
    InputError,
    StaticInput,
    is_capturing,
)
from devgraph.strategies import FullGraphBackend

SIZES = [1, 2, 4, 8]


class Affine:
    """forward(x, idx) = x @ w + b[idx]; records what it saw so tests can inspect capture."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.w = torch.randn(4, 3, generator=gen)
        self.b = torch.randn(10, 3, generator=gen)
        self.captured_sizes: list[int] = []
        self.gc_frozen_during_capture: list[bool] = []
        self.eager_calls = 0

    def __call__(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if is_capturing():
            self.captured_sizes.append(x.shape[0])
            self.gc_frozen_during_capture.append(gc.get_freeze_count() > 0)
        else:
            self.eager_calls += 1
        return x @ self.w + self.b[idx]


INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0), "idx": StaticInput(torch.int64, fill=9)}


def make_runner(fn=None, **kwargs) -> GraphRunner:
    kwargs.setdefault("mode", "full")
    kwargs.setdefault("sizes", SIZES)
    return GraphRunner(fn or Affine(), phase="decode", inputs=INPUTS, device="cpu", **kwargs)


def batch(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 4, generator=gen), "idx": torch.randint(0, 9, (n,), generator=gen)}


def test_capture_largest_first_with_gc_frozen_and_report():
    fn = Affine()
    runner = make_runner(fn)
    report = runner.capture()
    assert fn.captured_sizes == [8, 4, 2, 1]
    assert all(fn.gc_frozen_during_capture)
    assert gc.get_freeze_count() == 0 or not fn.gc_frozen_during_capture  # unfrozen afterwards
    assert [s.size for s in report.sizes] == SIZES
    assert all(s.seconds > 0 and s.bytes > 0 for s in report.sizes)
    assert report.backend == "full" and report.platform == "cpu"
    assert "size      8" in report.table()
    assert runner.capture() is report  # idempotent


def test_warmup_runs_before_each_capture():
    fn = Affine()
    make_runner(fn, warmup_iters=3).capture()
    assert fn.eager_calls == 3 * len(SIZES)


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_run_matches_eager_and_pads_with_fill(n):
    fn = Affine()
    runner = make_runner(fn)
    runner.capture()
    inputs = batch(n)
    out = runner.run(n, **inputs)
    assert out.shape == (n, 3)
    torch.testing.assert_close(out, fn(**inputs))
    size = runner.bucket(n)
    assert torch.all(runner.static_inputs["idx"][n:size] == 9)
    assert torch.all(runner.static_inputs["x"][n:size] == 0)


def test_outputs_keep_their_storage_across_runs():
    runner = make_runner()
    runner.capture()
    first = runner.run(8, **batch(8, seed=1))
    ptr, first_copy = first.data_ptr(), first.clone()
    second = runner.run(8, **batch(8, seed=2))
    assert second.data_ptr() == ptr
    assert not torch.equal(first_copy, second)


def test_n_defaults_to_first_input_length():
    runner = make_runner()
    runner.capture()
    assert runner.run(**batch(3)).shape[0] == 3


def test_eager_fallback_past_largest_and_before_capture():
    fn = Affine()
    runner = make_runner(fn)
    inputs = batch(5)
    torch.testing.assert_close(runner.run(5, **inputs), fn(**inputs))  # not captured yet: eager
    runner.capture()
    calls = fn.eager_calls
    big = batch(12)
    torch.testing.assert_close(runner.run(12, **big), fn(**big))
    assert fn.eager_calls == calls + 2  # the runner's fallback and the reference call above


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ({"x": torch.zeros(3, 4, dtype=torch.float64)}, "torch.float64"),
        ({"x": torch.zeros(3, 5)}, "shape (3, 5)"),
        ({"x": torch.zeros(2, 4)}, "shape (2, 4)"),
        ({"x": torch.zeros(3, 4, device="meta")}, "meta"),
        ({"x": [[0.0] * 4] * 3}, "list"),
    ],
)
def test_bad_input_raises_before_anything_is_written(bad, fragment):
    runner = make_runner()
    runner.capture()
    before = {k: v.clone() for k, v in runner.static_inputs.items()}
    inputs = {"idx": torch.ones(3, dtype=torch.int64), **bad}
    with pytest.raises(InputError) as info:
        runner.run(3, **inputs)
    assert fragment in str(info.value) and "nothing was written" in str(info.value)
    for name, value in runner.static_inputs.items():
        assert torch.equal(value, before[name])


def test_missing_and_unexpected_inputs():
    runner = make_runner()
    runner.capture()
    with pytest.raises(InputError, match=r"missing \['idx'\], unexpected \['y'\]"):
        runner.run(2, x=torch.zeros(2, 4), y=torch.zeros(2))


class ForgetfulRunner(GraphRunner):
    """A broken runner that never copies ``idx`` into its static buffer."""

    def _stage(self, n, size, inputs):
        super()._stage(
            n, size, {k: (self.static_inputs[k][:n] if k == "idx" else v) for k, v in inputs.items()}
        )


def test_runner_that_forgot_to_copy_an_input_is_caught():
    runner = ForgetfulRunner(Affine(), phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES)
    runner.capture()
    runner.run(4, **batch(4, seed=1))
    result = runner.verify(4, **batch(4, seed=2))
    assert result.replayed
    # The graph and an eager pass over the same (stale) static buffers agree; eager on the caller's
    # inputs does not, which is what exposes the missing copy.
    assert result.max_abs_diff == 0
    assert result.max_abs_diff_unpadded > 0.1
    assert not result.ok


def test_verify_reports_zero_for_a_correct_runner():
    runner = make_runner()
    runner.capture()
    for n in (1, 3, 8, 20):
        result = runner.verify(n, **batch(n))
        assert result.max_abs_diff == 0.0 and result.ok
        assert result.replayed == (n <= 8)


def test_capture_failure_names_size_and_releases_graphs():
    def forward(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2 and is_capturing():
            x.sum().item()  # a host sync, only at size 2
        return x * 2

    runner = make_runner(forward)
    reserved_before = runner.platform.reserved_bytes()
    with pytest.raises(CaptureError) as info:
        runner.capture()
    assert info.value.size == 2
    message = str(info.value)
    assert "size 2" in message and "_local_scalar_dense" in message and "released" in message
    assert runner.backend.captured_keys() == []
    assert runner.platform.reserved_bytes() == reserved_before
    assert runner.run(2, **batch(2)).shape == (2, 4)  # still usable, eagerly


def test_close_releases_graph_memory_and_context_manager():
    baseline = None
    with make_runner() as runner:
        baseline = runner.platform.reserved_bytes()
        runner.capture()
        assert runner.platform.reserved_bytes() > baseline
    assert runner.platform.reserved_bytes() == baseline
    assert runner.backend.captured_keys() == []
    with pytest.raises(ConfigError, match="closed"):
        runner.capture()


def test_can_run_false_sends_step_to_eager():
    class Picky(FullGraphBackend):
        def can_run(self, batch):
            return batch.context != "no-graph"

    fn = Affine()
    from devgraph import resolve_platform

    runner = make_runner(fn, backend=Picky(resolve_platform("cpu"), phase="decode"))
    runner.capture()
    calls = fn.eager_calls
    runner.run(4, context="no-graph", **batch(4))
    assert fn.eager_calls == calls + 1
    runner.run(4, context="graph", **batch(4))
    assert fn.eager_calls == calls + 1


def test_disabled_mode_never_captures():
    fn = Affine()
    runner = make_runner(fn, mode="disabled")
    report = runner.capture()
    assert report.sizes == [] and fn.captured_sizes == []
    inputs = batch(3)
    torch.testing.assert_close(runner.run(3, **inputs), fn(**inputs))


def test_mode_and_config_are_exclusive():
    with pytest.raises(ConfigError, match="either mode="):
        make_runner(mode="full", config="auto")


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


def test_host_input_lives_on_cpu_and_tuple_outputs_are_sliced():
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
