"""The CPU simulated graph: capture/replay semantics, capture rules, memory accounting."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from devgraph.contract.breaks import graph_break
from devgraph.contract.context import capturing, forward_context, get_forward_context
from devgraph.contract.platform import DeviceGraph, GraphPlatform
from devgraph.errors import CaptureError, ReplayError
from devgraph.platforms.sim import CpuSimPlatform, SimGraph, SimPool

pytestmark = pytest.mark.timeout(60)


# -- fixtures and helpers ----------------------------------------------------------------------------
def _stack_depths() -> tuple[int, int]:
    return torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()


@pytest.fixture
def platform() -> Iterator[CpuSimPlatform]:
    """A platform, and a check that the test left no mode behind once devgraph was called again."""
    depths = _stack_depths()
    sim = CpuSimPlatform()
    yield sim
    sim.abort_capture(sim.new_graph())  # settles a capture a test left failed, like the next capture would
    assert _stack_depths() == depths
    assert not sim.is_capturing()


def _capture(
    platform: CpuSimPlatform, fn: Callable[[], Any], pool: SimPool | None = None
) -> tuple[SimGraph, Any]:
    graph = platform.new_graph()
    platform.capture_begin(graph, pool)
    try:
        out = fn()
    except BaseException:
        platform.abort_capture(graph)
        raise
    platform.capture_end(graph)
    return graph, out


@graph_break("devgraph_test_sim::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    """A break op: captured like a device captures it, through the ops its body issues."""
    return x * 2


@graph_break("devgraph_test_sim::accumulate", mutates_args=("total",))
def accumulate(total: torch.Tensor, x: torch.Tensor) -> None:
    """A break op that writes into its argument."""
    total.add_(x)


@graph_break("devgraph_test_sim::accumulate_twice", mutates_args=("total",))
def accumulate_twice(total: torch.Tensor, x: torch.Tensor) -> None:
    """A break op whose body calls another break op: both bodies are traced op by op."""
    accumulate(total, x)
    accumulate(total, x)


@graph_break("devgraph_test_sim::scale_by_context", mutates_args=())
def scale_by_context(x: torch.Tensor) -> torch.Tensor:
    """A break op reading per-step host state, which a graph can only hold as captured."""
    return x * get_forward_context()


@graph_break("devgraph_test_sim::numpy_square", mutates_args=())
def numpy_square(x: torch.Tensor) -> torch.Tensor:
    """A break op whose body works on host memory: fine eagerly, not inside a device graph."""
    return torch.from_numpy(x.numpy() ** 2)


# An op with a kernel the recorder cannot look into (registered for the CPU key, as a C++ kernel
# would be): recorded, and re-run, as one op.
_LIB = torch.library.Library("devgraph_test_sim", "FRAGMENT")
_LIB.define("cube(Tensor x) -> Tensor")


def _cube_kernel(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out.numpy()[...] = x.numpy() ** 3  # no aten op does the work
    return out


_LIB.impl("cube", _cube_kernel, "CPU")


# -- replay semantics --------------------------------------------------------------------------------
def test_platform_satisfies_the_interfaces() -> None:
    sim = CpuSimPlatform()
    assert isinstance(sim, GraphPlatform)
    assert (sim.name, sim.device_type, sim.priority) == ("cpu", "cpu", 0)
    assert sim.availability().usable
    assert isinstance(sim.new_graph(), DeviceGraph)
    assert "cpu" in sim.describe()
    free, total = sim.mem_get_info()
    assert 0 < free <= total
    stream = sim.new_stream()
    with sim.stream(stream):
        assert sim.current_stream() is stream
    assert sim.current_stream() is not stream
    sim.synchronize()


def test_op_info_writes_exactly_where_the_schema_is_mutable() -> None:
    """Capture re-runs every op that writes an argument: ``writes`` stands for ``schema.is_mutable``."""
    from devgraph.platforms.sim.ops import op_info

    aten = torch.ops.aten
    overloads = [
        aten.add.Tensor,
        aten.add_.Tensor,
        aten.add.out,
        aten.view.default,
        aten.copy_.default,
        aten._foreach_add_.Scalar,
        aten.index_put_.default,
        aten.empty.memory_format,
        aten.resize_.default,
    ]
    for func in overloads:
        assert bool(op_info(func).writes) == func._schema.is_mutable, func
    assert [name for _, name in op_info(aten.add.out).writes] == ["out"]


def test_replay_keeps_output_identity_and_storage(platform: CpuSimPlatform) -> None:
    x = torch.randn(4, 3)
    w = torch.randn(3, 5)
    graph, (h, out) = _capture(platform, lambda: (x @ w, torch.relu(x @ w).sum(0)))
    out_id, out_ptr, h_ptr = id(out), out.data_ptr(), h.data_ptr()
    for _ in range(3):
        x.copy_(torch.randn(4, 3))
        graph.replay()
        assert id(out) == out_id
        assert out.data_ptr() == out_ptr and h.data_ptr() == h_ptr
        torch.testing.assert_close(out, torch.relu(x @ w).sum(0))
        torch.testing.assert_close(h, x @ w)


def test_mutated_input_flows_through_replay(platform: CpuSimPlatform) -> None:
    x = torch.zeros(5)
    graph, y = _capture(platform, lambda: torch.sin(x) * 2 + 1)
    x[2] = 1.5
    graph.replay()
    torch.testing.assert_close(y, torch.sin(x) * 2 + 1)


def test_rebound_input_gives_stale_result(platform: CpuSimPlatform) -> None:
    x = torch.ones(3)
    graph, y = _capture(platform, lambda: x + 1)
    x = torch.full((3,), 10.0)  # a new tensor: the graph still reads the old one
    graph.replay()
    torch.testing.assert_close(y, torch.full((3,), 2.0))


def test_in_place_ops_and_views_replay_like_eager(platform: CpuSimPlatform) -> None:
    x = torch.arange(6.0)

    def forward() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buf = torch.zeros(6)
        buf.add_(x)  # re-zeroed by replaying `zeros`, so replays do not accumulate
        window = buf[1:4]  # a view: not re-run, keeps aliasing buf
        window.mul_(10)
        grid = buf.view(2, 3).t()
        return buf, window, grid

    graph, (buf, window, grid) = _capture(platform, forward)
    assert window.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    for shift in (1.0, 5.0):
        x.add_(shift)
        graph.replay()
        graph.replay()  # twice: in-place steps must not compound
        expected = x.clone()
        expected[1:4] *= 10
        torch.testing.assert_close(buf, expected)
        torch.testing.assert_close(window, expected[1:4])
        torch.testing.assert_close(grid, expected.view(2, 3).t())
    assert "aten.slice.Tensor" not in graph.op_names and "aten.t.default" not in graph.op_names


def test_in_place_write_to_a_captured_input_repeats_each_replay(platform: CpuSimPlatform) -> None:
    state = torch.zeros(2)
    graph, _ = _capture(platform, lambda: state.add_(1))
    assert state.tolist() == [0.0, 0.0]  # as on a device: the capture records the write, makes none
    graph.replay()
    graph.replay()
    assert state.tolist() == [2.0, 2.0]  # as on a device: the kernel writes again on every launch


def test_multi_output_ops_replay(platform: CpuSimPlatform) -> None:
    x = torch.randn(4, 6)

    def forward() -> tuple[torch.Tensor, ...]:
        values, indices = torch.max(x * 1, dim=0)
        first, second = torch.split(x.exp(), 3, dim=1)
        return values, indices, first, second

    graph, (values, indices, first, second) = _capture(platform, forward)
    x.copy_(torch.randn(4, 6))
    graph.replay()
    expected = torch.max(x, dim=0)
    torch.testing.assert_close(values, expected.values)
    torch.testing.assert_close(indices, expected.indices)
    torch.testing.assert_close(first, x.exp()[:, :3])
    torch.testing.assert_close(second, x.exp()[:, 3:])


def test_composite_reshapes_and_unsafe_views_replay(platform: CpuSimPlatform) -> None:
    a = torch.randn(2, 3, 4)
    b = torch.randn(4, 5)
    graph, out = _capture(platform, lambda: torch.matmul(a, b).reshape(6, 5).softmax(-1))
    a.copy_(torch.randn(2, 3, 4))
    graph.replay()
    torch.testing.assert_close(out, torch.matmul(a, b).reshape(6, 5).softmax(-1))


def test_alias_annotated_op_that_copies_is_re_run(platform: CpuSimPlatform) -> None:
    x = torch.arange(6.0).view(2, 3)
    with torch.inference_mode():  # autograd off: reshape reaches the recorder whole, not decomposed
        graph, (flat, view) = _capture(platform, lambda: (x.t().reshape(6), x.reshape(6)))
    assert flat.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # copied: not a view
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a real view
    x.add_(10)
    graph.replay()
    assert flat.tolist() == x.t().reshape(6).tolist()
    assert view.tolist() == x.reshape(6).tolist()


def test_capture_in_inference_mode_replays_outside_it(platform: CpuSimPlatform) -> None:
    x = torch.randn(3)
    with torch.inference_mode():
        graph, y = _capture(platform, lambda: x.exp())
    x.copy_(torch.randn(3))
    graph.replay()  # writes into an inference tensor outside inference mode, as a kernel would
    torch.testing.assert_close(y, x.exp())


def test_capture_works_inside_and_outside_capture_flag(platform: CpuSimPlatform) -> None:
    x = torch.ones(2)
    with capturing():
        inside, y = _capture(platform, lambda: x * 3)
    outside, z = _capture(platform, lambda: x * 4)
    x.fill_(2.0)
    inside.replay()
    outside.replay()
    assert y.tolist() == [6.0, 6.0] and z.tolist() == [8.0, 8.0]


def test_ops_on_other_threads_are_not_recorded(platform: CpuSimPlatform) -> None:
    x = torch.ones(2)
    side = torch.zeros(2)
    graph = platform.new_graph()
    platform.capture_begin(graph, None)
    y = x + 1
    worker = threading.Thread(target=lambda: side.add_(1))
    worker.start()
    worker.join()
    platform.capture_end(graph)
    graph.replay()
    assert side.tolist() == [1.0, 1.0]
    assert graph.op_names == ("aten.add.Tensor",)
    assert y.tolist() == [2.0, 2.0]


# -- capture rules -----------------------------------------------------------------------------------
_x = torch.tensor([0.0, 1.5, -2.0, 1.5])

HOST_SYNCS: dict[str, tuple[Callable[[], Any], str]] = {
    "item": (lambda: (_x * 2).sum().item(), "aten._local_scalar_dense"),
    "tolist": (lambda: (_x * 2).tolist(), "aten._local_scalar_dense"),
    "bool": (lambda: bool((_x > 0).any()), "aten._local_scalar_dense"),
    "int": (lambda: int(_x[1]), "aten._local_scalar_dense"),
    "nonzero": (lambda: torch.nonzero(_x), "aten.nonzero"),
    "masked_select": (lambda: _x.masked_select(_x > 0), "aten.masked_select"),
    "unique": (lambda: torch.unique(_x), "aten._unique2"),
    "bool_mask_index": (lambda: _x[_x > 0], "aten.index"),
    "equal": (lambda: torch.equal(_x, _x), "aten.equal"),
    "repeat_interleave": (
        lambda: torch.repeat_interleave(_x, torch.tensor([1, 2, 0, 1])),
        "aten.repeat_interleave",
    ),
}


@pytest.mark.parametrize("case", sorted(HOST_SYNCS))
def test_host_syncs_raise_and_leave_no_mode(platform: CpuSimPlatform, case: str) -> None:
    fn, op = HOST_SYNCS[case]
    dispatch_depth, function_depth = _stack_depths()
    graph = platform.new_graph()
    platform.capture_begin(graph, platform.graph_pool_handle())
    with pytest.raises(CaptureError) as info:
        fn()
    assert info.value.op == op
    assert op in str(info.value) and "cannot be captured" in str(info.value)
    # The recorder left the dispatch stack with the error; the graph holds nothing.
    assert torch._C._len_torch_dispatch_stack() == dispatch_depth
    assert not graph.is_captured
    with pytest.raises(ReplayError, match="capture failed"):
        graph.replay()
    with pytest.raises(CaptureError, match="already ended by an error"):
        platform.capture_end(graph)
    assert _stack_depths() == (dispatch_depth, function_depth)
    # A later capture, into the same graph, works normally.
    y_in = torch.ones(2)
    platform.capture_begin(graph, None)
    y = y_in * 5
    platform.capture_end(graph)
    y_in.fill_(2.0)
    graph.replay()
    assert y.tolist() == [10.0, 10.0]


def test_item_error_message_says_what_to_do(platform: CpuSimPlatform) -> None:
    graph = platform.new_graph()
    platform.capture_begin(graph, None)
    with pytest.raises(CaptureError) as info:
        _x.sum().item()
    assert str(info.value).startswith("`.item()` (aten._local_scalar_dense) syncs with the host")
    assert "forward context" in str(info.value)
    platform.abort_capture(graph)


def test_static_shaped_variants_are_allowed(platform: CpuSimPlatform) -> None:
    x = torch.tensor([1.0, -1.0, 2.0])
    idx = torch.tensor([2, 0])

    def forward() -> tuple[torch.Tensor, ...]:
        masked = torch.where(x > 0, x, torch.zeros_like(x))
        picked = x[idx]  # integer indexing keeps a static shape
        repeated = torch.repeat_interleave(x, torch.tensor([1, 2, 1]), output_size=4)
        return masked, picked, repeated

    graph, (masked, picked, repeated) = _capture(platform, forward)
    x.copy_(torch.tensor([-3.0, 4.0, 5.0]))
    graph.replay()
    assert masked.tolist() == [0.0, 4.0, 5.0]
    assert picked.tolist() == [5.0, -3.0]
    assert repeated.tolist() == [-3.0, 4.0, 4.0, 5.0]


def test_nested_capture_raises_and_outer_capture_survives(platform: CpuSimPlatform) -> None:
    x = torch.ones(2)
    outer, inner = platform.new_graph(), platform.new_graph()
    platform.capture_begin(outer, None)
    y = x + 1
    with pytest.raises(CaptureError, match="nested capture"):
        platform.capture_begin(inner, None)
    z = y * 3
    platform.capture_end(outer)
    x.fill_(2.0)
    outer.replay()
    assert z.tolist() == [9.0, 9.0]
    assert not inner.is_captured


def test_capture_end_and_replay_misuse(platform: CpuSimPlatform) -> None:
    graph = platform.new_graph()
    with pytest.raises(CaptureError, match="not capturing"):
        platform.capture_end(graph)
    with pytest.raises(ReplayError):
        graph.replay()
    captured, _ = _capture(platform, lambda: torch.ones(2) * 2)
    with pytest.raises(CaptureError, match="already holds a capture"):
        platform.capture_begin(captured, None)
    captured.reset()
    with pytest.raises(ReplayError):
        captured.replay()


def test_abort_capture_mid_way_leaves_the_graph_empty(platform: CpuSimPlatform) -> None:
    graph = platform.new_graph()
    platform.capture_begin(graph, None)
    torch.ones(3) * 2
    platform.abort_capture(graph)
    assert not platform.is_capturing() and not graph.is_captured
    assert _stack_depths() == (0, 0)


# -- memory ------------------------------------------------------------------------------------------
def test_reset_frees_memory_and_references(platform: CpuSimPlatform) -> None:
    x = torch.randn(64, 64)
    gc.collect()  # graphs of earlier tests that only a traceback cycle still holds
    before = platform.reserved_bytes()
    pool = platform.graph_pool_handle()

    def forward() -> tuple[torch.Tensor, weakref.ref[torch.Tensor]]:
        hidden = x @ x  # an intermediate only the graph keeps
        return (hidden + 1).sum(), weakref.ref(hidden)

    graph, (out, hidden_ref) = _capture(platform, forward, pool)
    held = platform.reserved_bytes() - before
    assert held == graph.nbytes == pool.nbytes
    assert held >= 2 * 64 * 64 * 4  # x @ x and hidden + 1, counted once each
    assert hidden_ref() is not None
    graph.reset()
    gc.collect()
    assert platform.reserved_bytes() == before
    assert pool.nbytes == 0
    assert hidden_ref() is None


def test_dropped_graph_releases_its_bytes(platform: CpuSimPlatform) -> None:
    gc.collect()
    before = platform.reserved_bytes()
    x = torch.randn(32)
    graph, _ = _capture(platform, lambda: x.exp())
    assert platform.reserved_bytes() > before
    del graph
    gc.collect()
    assert platform.reserved_bytes() == before


def test_two_graphs_share_one_pool(platform: CpuSimPlatform) -> None:
    pool = platform.graph_pool_handle()
    x = torch.randn(8)
    first, a = _capture(platform, lambda: x * 2, pool)
    second, b = _capture(platform, lambda: (x + 1).exp(), pool)
    assert pool.num_graphs == 2
    assert pool.nbytes == first.nbytes + second.nbytes > 0
    x.copy_(torch.randn(8))
    second.replay()
    first.replay()
    torch.testing.assert_close(a, x * 2)
    torch.testing.assert_close(b, (x + 1).exp())
    first.reset()
    assert pool.nbytes == second.nbytes


# -- opaque calls and custom ops ---------------------------------------------------------------------
def test_record_opaque_replays_a_call_the_recorder_cannot_see(platform: CpuSimPlatform) -> None:
    x = torch.arange(4.0)

    def through_numpy(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        out.numpy()[...] = t.numpy() ** 2  # no aten op does the work
        return out

    def forward() -> torch.Tensor:
        return platform.record_opaque(through_numpy, x * 1) + 1

    graph, y = _capture(platform, forward)
    assert graph.op_names[1].startswith("opaque:") and "aten.empty_like.default" not in graph.op_names
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    graph.replay()
    assert y.tolist() == [26.0, 37.0, 50.0, 65.0]
    assert platform.record_opaque(through_numpy, torch.tensor([3.0])).tolist() == [9.0]  # not capturing


def test_graph_break_op_replays_correctly(platform: CpuSimPlatform) -> None:
    x = torch.tensor([1.0, 2.0])
    total = torch.zeros(2)

    def forward() -> torch.Tensor:
        y = double(x) + 1
        accumulate(total, y)
        return y

    graph, y = _capture(platform, forward)
    assert y.tolist() == [3.0, 5.0] and total.tolist() == [0.0, 0.0]  # the write is undone at capture end
    x.copy_(torch.tensor([10.0, 20.0]))
    graph.replay()
    assert y.tolist() == [21.0, 41.0]
    assert total.tolist() == [21.0, 41.0]  # the write into `total` is part of the graph
    # Captured like a device captures it: the ops the bodies issued, not the Python bodies.
    assert graph.op_names == ("aten.mul.Tensor", "aten.add.Tensor", "aten.add_.Tensor")


def test_graph_break_op_bakes_host_state_read_at_capture(platform: CpuSimPlatform) -> None:
    x = torch.tensor([1.0, 2.0])
    with forward_context(3.0):
        graph, y = _capture(platform, lambda: scale_by_context(x))
    with forward_context(-1.0):
        graph.replay()  # a device replays the kernel with the scalar it was launched with
    assert y.tolist() == [3.0, 6.0]
    with forward_context(-1.0):
        assert scale_by_context(x).tolist() == [-1.0, -2.0]  # eagerly, the op reads the live context


def test_host_read_inside_a_graph_break_op_raises(platform: CpuSimPlatform) -> None:
    graph = platform.new_graph()
    platform.capture_begin(graph, None)
    with pytest.raises(CaptureError, match=r"\.numpy\(\)"):
        numpy_square(torch.ones(2))
    platform.abort_capture(graph)
    assert numpy_square(torch.full((2,), 3.0)).tolist() == [9.0, 9.0]  # fine outside capture


def test_op_with_an_opaque_kernel_is_recorded_whole(platform: CpuSimPlatform) -> None:
    x = torch.tensor([1.0, 2.0])
    graph, y = _capture(platform, lambda: torch.ops.devgraph_test_sim.cube(x) + 1)
    assert graph.op_names == ("devgraph_test_sim.cube.default", "aten.add.Tensor")
    x.fill_(3.0)
    graph.replay()
    assert y.tolist() == [28.0, 28.0]


def test_failing_step_raises_replay_error(platform: CpuSimPlatform) -> None:
    x = torch.ones(3)

    def fragile(t: torch.Tensor) -> torch.Tensor:
        if t.numpy()[0] < 0:
            raise ValueError("negative input")
        return t * 2

    graph, _ = _capture(platform, lambda: platform.record_opaque(fragile, x))
    x.fill_(-1.0)
    with pytest.raises(ReplayError, match="negative input") as info:
        graph.replay()
    assert isinstance(info.value.__cause__, ValueError)


def test_record_opaque_runs_outside_the_mode_stacks(platform: CpuSimPlatform) -> None:
    seen: list[tuple[int, int]] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(_stack_depths())
        return t + 1

    x = torch.zeros(2)
    depths = _stack_depths()
    graph, y = _capture(platform, lambda: platform.record_opaque(probe, x))
    x.fill_(4.0)
    graph.replay()
    assert seen == [depths, depths]  # no recorder, no guard: compiled code runs as compiled
    assert y.tolist() == [5.0, 5.0]


def test_compiled_function_replays_through_record_opaque(platform: CpuSimPlatform) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch.relu(t * 2) - 1, backend="eager")
    x = torch.randn(6)
    compiled(x)  # compile before capture, as tc_piecewise warms up
    graph, y = _capture(platform, lambda: platform.record_opaque(compiled, x))
    assert len(graph.op_names) == 1 and graph.op_names[0].startswith("opaque:")
    x.copy_(torch.randn(6))
    graph.replay()
    torch.testing.assert_close(y, torch.relu(x * 2) - 1)


def test_capture_with_parameters_that_require_grad(platform: CpuSimPlatform) -> None:
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    graph, y = _capture(platform, lambda: torch.tanh(layer(x)))  # no no_grad: autograd is live
    x.copy_(torch.randn(2, 4))
    graph.replay()  # ops re-run below autograd, so writing into outputs that require grad is fine
    with torch.no_grad():
        torch.testing.assert_close(y, torch.tanh(layer(x)))


def test_graph_replayed_during_another_capture_becomes_one_step(platform: CpuSimPlatform) -> None:
    x = torch.ones(3)
    inner, doubled = _capture(platform, lambda: x * 2)

    def outer_forward() -> torch.Tensor:
        inner.replay()
        return doubled + 1

    outer, out = _capture(platform, outer_forward)
    assert outer.op_names[0].startswith("opaque:")
    x.fill_(5.0)
    outer.replay()
    assert out.tolist() == [11.0, 11.0, 11.0]


# -- side effects: a capture leaves older memory as it found it, as a device capture does ---------------
def test_captured_counter_is_unchanged_by_capture_and_advances_once_per_replay(
    platform: CpuSimPlatform,
) -> None:
    counter = torch.zeros((), dtype=torch.int64)  # a stateful forward's step counter

    def forward() -> torch.Tensor:
        counter.add_(1)
        return counter * 10

    graph, out = _capture(platform, forward)
    assert int(counter) == 0
    assert int(out) == 10  # computed during the capture into memory the capture allocated: kept
    for step in (1, 2, 3):
        graph.replay()
        assert int(counter) == step and int(out) == 10 * step


def test_cache_write_is_undone_at_capture_end_and_redone_at_replay(platform: CpuSimPlatform) -> None:
    cache = torch.zeros(4, 3)  # a KV cache that exists before the capture
    slots = torch.tensor([2])  # static inputs of the step
    new = torch.ones(1, 3)

    def forward() -> torch.Tensor:
        cache[slots] = new * 5  # aten.index_put_
        return cache.sum(0)

    graph, column_sums = _capture(platform, forward)
    assert "aten.index_put_.default" in graph.op_names
    assert torch.equal(cache, torch.zeros(4, 3))
    assert column_sums.tolist() == [5.0, 5.0, 5.0]
    slots.fill_(0)
    new.fill_(2.0)
    graph.replay()
    expected = torch.zeros(4, 3)
    expected[0] = 10.0
    assert torch.equal(cache, expected)
    assert column_sums.tolist() == [10.0, 10.0, 10.0]


# Each way an op writes an argument, applied to memory that exists before the capture.
WRITES: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "in_place": lambda t, v: t.mul_(v).add_(v),
    "out_variant": lambda t, v: torch.add(v, 1, out=t),
    "copy": lambda t, v: t.copy_(v * 3),
    "index_put": lambda t, v: t.index_put_((torch.tensor([0, 2]),), v[:2]),
    "foreach": lambda t, v: torch._foreach_add_([t], [v]),
    "fill_view": lambda t, v: t[1:].fill_(-1.0),
    "break_op": lambda t, v: accumulate(t, v),
    "nested_break_ops": lambda t, v: accumulate_twice(t, v),
}


@pytest.mark.parametrize("kind", sorted(WRITES))
def test_every_kind_of_write_to_older_memory_is_undone_and_replayed(
    platform: CpuSimPlatform, kind: str
) -> None:
    write = WRITES[kind]
    target = torch.tensor([1.0, 2.0, 3.0])
    values = torch.tensor([4.0, 5.0, 6.0])
    graph, _ = _capture(platform, lambda: write(target, values))
    assert target.tolist() == [1.0, 2.0, 3.0]
    expected = target.clone()
    write(expected, values)  # what one eager step does
    graph.replay()
    assert target.tolist() == expected.tolist()


def test_write_through_views_of_an_older_tensor_is_undone(platform: CpuSimPlatform) -> None:
    base = torch.arange(12.0).view(3, 4)
    window = base.view(-1)[2:10]  # a view made before the capture, offset into the storage
    before = base.clone()

    def forward() -> torch.Tensor:
        base[1].mul_(-1)  # a row view
        base.t()[0].fill_(0.0)  # a strided column view
        window.add_(100)
        return base.sum()

    graph, total = _capture(platform, forward)
    assert torch.equal(base, before)
    graph.replay()
    expected = before.clone()
    expected[1] *= -1
    expected[:, 0] = 0.0
    expected.view(-1)[2:10] += 100
    assert torch.equal(base, expected)
    assert total.item() == expected.sum().item()


FAILING_CALLS: dict[str, Callable[[torch.Tensor], Any]] = {
    "item": lambda t: t.sum().item(),  # fails in the dispatch mode
    "tolist": lambda t: t.tolist(),  # fails in the function mode
    "nonzero": lambda t: torch.nonzero(t),
    "in_break_op_body": lambda t: numpy_square(t),  # fails inside a traced custom-op body
}


@pytest.mark.parametrize("case", sorted(FAILING_CALLS))
def test_failed_capture_leaves_older_tensors_unchanged(platform: CpuSimPlatform, case: str) -> None:
    counter = torch.zeros(2)
    cache = torch.zeros(4)
    graph = platform.new_graph()
    platform.capture_begin(graph, None)
    counter.add_(1)
    cache[1:3].fill_(7.0)
    accumulate(counter, torch.ones(2))
    with pytest.raises(CaptureError):
        FAILING_CALLS[case](counter * 1)
    assert counter.tolist() == [0.0, 0.0] and cache.tolist() == [0.0, 0.0, 0.0, 0.0]
    counter.add_(1)  # after the failure, code runs eagerly: nothing more is recorded or undone
    platform.abort_capture(graph)
    assert counter.tolist() == [1.0, 1.0]
    assert not graph.is_captured


def test_aborted_capture_leaves_older_tensors_unchanged(platform: CpuSimPlatform) -> None:
    state = torch.zeros(3)
    graph = platform.new_graph()
    platform.capture_begin(graph, None)
    state.add_(2)
    scratch = torch.zeros(3).add_(state)
    platform.abort_capture(graph)  # e.g. the forward raised an error of its own
    assert state.tolist() == [0.0, 0.0, 0.0]
    assert scratch.tolist() == [2.0, 2.0, 2.0]  # allocated by the capture: not older memory


def test_tensors_allocated_in_the_capture_keep_their_values(platform: CpuSimPlatform) -> None:
    weight = torch.full((3,), 2.0)
    state = torch.zeros(3)

    def forward() -> tuple[torch.Tensor, ...]:
        buf = torch.zeros(3)
        buf.add_(weight)  # written in place, but the capture's own memory
        literal = torch.tensor([1.0, 2.0, 3.0])  # made from Python data during the capture
        literal.mul_(weight)
        state.add_(buf)  # older memory: undone
        return buf, literal, state * 1

    graph, (buf, literal, seen) = _capture(platform, forward)
    assert buf.tolist() == [2.0, 2.0, 2.0]
    assert literal.tolist() == [2.0, 4.0, 6.0]
    assert seen.tolist() == [2.0, 2.0, 2.0]  # what the capture computed from the state it wrote
    assert state.tolist() == [0.0, 0.0, 0.0]
    graph.replay()
    assert buf.tolist() == [2.0, 2.0, 2.0] and state.tolist() == [2.0, 2.0, 2.0]


def test_opaque_calls_keep_their_side_effects(platform: CpuSimPlatform) -> None:
    """The documented limit: a call recorded whole is not seen op by op, so its writes stay."""
    state = torch.zeros(2)
    graph, _ = _capture(platform, lambda: platform.record_opaque(state.add_, 1))
    assert state.tolist() == [1.0, 1.0]
    graph.replay()
    assert state.tolist() == [2.0, 2.0]


def test_host_reads_inside_cpp_kernels_are_caught(platform: CpuSimPlatform) -> None:
    # nn.TransformerEncoder's fast path reads the padding mask on the host to build nested tensors; a device
    # capture rejects that, so the simulator must too (instead of baking the capture-time mask in).
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1)
    encoder.eval()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False, False, True, True, True]])
    with torch.no_grad(), pytest.raises(CaptureError, match="nested_tensor_from_mask"):
        _capture(platform, lambda: encoder(x, src_key_padding_mask=mask))
    lengths = torch.tensor([5, 2])
    with pytest.raises(CaptureError, match="pack_padded_sequence"):
        _capture(platform, lambda: torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True))
