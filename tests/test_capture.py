"""The capture loop and its failures: largest first, warm-ups, the report, and advice that fits the cause."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import devgraph
from devgraph import CaptureError, GraphRunner, StaticInput, is_capturing
from devgraph.contract.keys import GraphKey
from devgraph.runner.capture.advice import diagnose

SIZES = [1, 2, 4]
INPUTS = {"x": StaticInput(torch.float32, (3,), fill=0.0)}


def make(forward, mode: str = "full", **kwargs) -> GraphRunner:
    kwargs.setdefault("sizes", SIZES)
    return GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode=mode, **kwargs)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.gc_frozen: list[bool] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.events.append(("capture" if is_capturing() else "eager", x.shape[0]))
        self.gc_frozen.append(gc.get_freeze_count() > 0)
        return x * 2


def test_capture_runs_warmups_then_captures_largest_first_with_gc_frozen():
    fn = Recorder()
    contexts = []
    runner = make(fn, warmup_iters=2, capture_context=lambda key: contexts.append(key) or {"key": key})
    report = runner.capture()
    expected = []
    for size in (4, 2, 1):
        expected += [("eager", size), ("eager", size), ("capture", size)]
    assert fn.events == expected
    assert all(fn.gc_frozen) and gc.get_freeze_count() == 0
    assert contexts == [GraphKey(4), GraphKey(2), GraphKey(1)]
    assert [k.key.tokens for k in report.keys] == SIZES and [k.size for k in report.sizes] == SIZES
    assert all(k.seconds > 0 and k.bytes >= 0 for k in report.keys)
    assert report.seconds >= sum(k.seconds for k in report.keys)
    assert report.backend == "full" and report.platform == "cpu" and report.phase == "decode"
    assert "3 graphs" in report.table() and "tokens=4" in report.table()
    assert runner.capture() is report  # once; a second call returns the same report
    assert len(fn.events) == len(expected)


def test_warmup_iters_zero_and_out_of_range():
    fn = Recorder()
    make(fn, warmup_iters=0).capture()
    assert fn.events == [("capture", 4), ("capture", 2), ("capture", 1)]
    with pytest.raises(devgraph.ConfigError, match="warmup_iters must be an int in"):
        make(fn, warmup_iters=17)


def test_lazy_runner_captures_nothing_at_start_up():
    fn = Recorder()
    report = make(fn, lazy=True).capture()
    assert report.keys == [] and fn.events == []


# -- failures and their advice --------------------------------------------------------------------------
@devgraph.graph_break("test_capture::returns_view")
def returns_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, 3)  # a view of its input: torch's custom-op checks refuse it


def with_view_break(x: torch.Tensor) -> torch.Tensor:
    return returns_view(x * 2) + 1


def host_sync_at_2(x: torch.Tensor) -> torch.Tensor:
    if is_capturing() and x.shape[0] == 2:
        x.sum().item()
    return x * 2


def oom_at_2(x: torch.Tensor) -> torch.Tensor:
    if is_capturing() and x.shape[0] == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return x * 2


def host_oom_at_2(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 2:
        torch.empty(2**60, dtype=torch.uint8)  # the CPU allocator refuses: "can't allocate memory"
    return x * 2


def _capture_error(runner: GraphRunner) -> CaptureError:
    before = runner.platform.reserved_bytes()
    with pytest.raises(CaptureError) as info:
        runner.capture()
    assert runner.backend.captured_keys() == []  # graphs captured so far were released
    assert runner.platform.reserved_bytes() <= before
    assert "released" in str(info.value)
    return info.value


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_break_op_returning_a_view_gets_the_return_a_new_tensor_advice(mode):
    error = _capture_error(make(with_view_break, mode))
    message = str(error)
    assert error.cause == "break_op_returns_view"
    assert "must return new tensors" in message and "clone()" in message
    assert "max_size" not in message and "lower" not in message  # fewer sizes cannot help here
    assert "does not help" in message


def test_host_sync_gets_host_sync_advice_and_names_the_key():
    error = _capture_error(make(host_sync_at_2))
    message = str(error)
    assert error.cause == "host_sync" and error.size == 2 and error.key == GraphKey(2)
    assert "tokens=2" in message and "_local_scalar_dense" in message
    assert "forward context" in message and "breakable" in message
    assert "max_size" not in message


def test_a_cpu_allocation_failure_gets_the_memory_advice_too():
    error = _capture_error(make(host_oom_at_2))  # before: the generic "run it eagerly" advice
    assert error.cause == "out_of_memory" and "can't allocate memory" in str(error)
    assert "lower max_size" in str(error)


def test_out_of_memory_gets_memory_advice_naming_max_size():
    runner = make(oom_at_2)
    error = _capture_error(runner)
    message = str(error)
    assert error.cause == "out_of_memory" and error.size == 2
    assert "max_size is 4" in message and "lower max_size" in message
    assert "decode=disabled" in message
    assert runner.run(x=torch.ones(2, 3)).shape == (2, 3)  # still usable, eagerly


def test_unknown_failure_gets_the_generic_advice():
    def broken(x: torch.Tensor) -> torch.Tensor:
        if is_capturing():
            raise RuntimeError("the kernel library refused")
        return x

    error = _capture_error(make(broken))
    assert error.cause == "unknown" and "run the forward eagerly" in str(error)


def test_diagnose_looks_through_wrapped_errors():
    try:
        try:
            raise torch.OutOfMemoryError("out of memory")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("while capturing") from inner
    except RuntimeError as outer:
        cause = diagnose(outer, phase="prefill", max_size=512)
    assert cause.name == "out_of_memory" and "max_size is 512" in cause.advice
    assert diagnose(CaptureError("x", op="aten.nonzero"), phase="decode", max_size=8).name == "host_sync"
    assert diagnose(devgraph.RecompileError("r"), phase="decode", max_size=8).name == "recompile"


def test_a_library_handle_created_inside_capture_gets_warm_up_advice():
    # What a CUDA capture raises when cuBLAS meets its first GEMM inside the capture (no warm-up).
    error = RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`")
    cause = diagnose(error, phase="decode", max_size=64)
    assert cause.name == "no_warm_up"
    assert "warmup_iters" in cause.advice and "max_size" not in cause.advice


def test_cuda_platform_leaves_the_cublas_handle_failure_to_the_advice_table_so_it_is_advised_once():
    from types import SimpleNamespace

    from devgraph.runner.capture.job import capture_failure

    platform = pytest.importorskip("devgraph_cuda.platform").CudaPlatform()
    error = RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`")
    job = SimpleNamespace(platform=platform, phase="decode", max_size=8, backend=SimpleNamespace(name="full"))
    message = str(capture_failure(error, job, GraphKey(4)))  # type: ignore[arg-type]
    assert "CUBLAS_STATUS_NOT_INITIALIZED" in message  # the original error line is kept
    assert message.count("warm the forward up") == 1


def test_advice_under_breakable_never_suggests_breakable():
    cause = diagnose(RuntimeError("something odd"), phase="prefill", max_size=64, backend="breakable")
    assert "prefill=breakable" not in cause.advice and "prefill=disabled" in cause.advice
    sync = diagnose(CaptureError("x", op="aten.nonzero"), phase="prefill", max_size=64, backend="breakable")
    assert "prefill=breakable" not in sync.advice


def test_a_forward_that_takes_only_some_sizes_still_captures_when_the_layout_probe_fails(caplog):
    # The probe runs one size below the captured one; this forward needs a multiple of 8 rows.
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 8, x.shape[-1]).sum(1).repeat_interleave(8, 0)

    runner = GraphRunner(
        forward,
        phase="prefill",
        inputs={"x": StaticInput(torch.float32, (2,))},
        device="cpu",
        mode="full",
        sizes=[16],
    )
    with caplog.at_level(logging.WARNING, logger="devgraph.runner"):
        runner.capture()
    assert any("output_axes" in r.getMessage() for r in caplog.records)
    assert runner.run(x=torch.ones(16, 2)).shape == (16, 2)


# -- progress: a bar on a terminal, a log line per key elsewhere (a server's log shows start-up moving) --
def test_show_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(monkeypatch):
    from devgraph.runner.capture.job import show_progress

    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert show_progress(None, rank=0) == "log" and show_progress(None, rank=1) == "off"
    assert show_progress(False, rank=0) == "log"  # no bar asked for; the lines still follow the log level
    assert show_progress(True, rank=0) == "bar"
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert show_progress(None, rank=0) == "bar" and show_progress(None, rank=1) == "off"


def test_capture_off_a_terminal_logs_one_line_per_key(caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="devgraph.runner.capture.job"):
        make(Recorder()).capture()
    lines = [r.getMessage() for r in caplog.records if r.name == "devgraph.runner.capture.job"]
    assert [line.split(" (")[0] for line in lines] == [
        "captured decode graph 1/3",
        "captured decode graph 2/3",
        "captured decode graph 3/3",
    ]
    assert "tokens=4" in lines[0] and "full" in lines[0] and lines[0].endswith(" s")
    caplog.clear()
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)  # a terminal: the bar, and no lines
    with caplog.at_level(logging.INFO, logger="devgraph.runner.capture.job"):
        make(Recorder()).capture()
    assert not [r for r in caplog.records if r.name == "devgraph.runner.capture.job"]
