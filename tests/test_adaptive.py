"""One compile across sizes, and compiles per size where dynamo cannot trace that one
(``devgraph.strategies.adaptive``): a forward that specialises on the batch size runs into dynamo's
recompile limit with one code object; each size then compiles with static shapes, is reported, and is
refused only where no compile can run it, with advice that names the cause."""

from __future__ import annotations

import logging

import pytest
import torch

import devgraph
from devgraph import CaptureError, GraphRunner, StaticInput
from devgraph.integrations.hf.regions import CompiledRegion
from devgraph.platforms.sim.platform import CpuSimPlatform
from devgraph.strategies.adaptive import AdaptiveCompile, compile_error_kind

SIZES = list(range(1, 11))  # ten sizes: more than dynamo's recompile limit (8) for one code object
INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0)}
#: A table keyed by the batch size, as engines keep per-size buffers: dynamo guards on the size it reads.
SCALE = {b: torch.full((4,), float(b)) for b in range(1, 65)}


def per_size(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * SCALE[x.shape[0]]


def untraceable(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return x + 1


def reads_a_value(x: torch.Tensor) -> torch.Tensor:
    if x.sum().long().item() > 3:  # a branch on a value read from the tensor
        return x * 2
    return x


def compiled(backend: str, forward=per_size, sizes=SIZES) -> GraphRunner:
    config = f'{{"decode": {{"backend": "{backend}", "compiler": "eager"}}}}'
    return GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=sizes, config=config)


@pytest.mark.parametrize("backend", ["full", "tc_piecewise"])
def test_a_forward_that_specialises_on_the_batch_compiles_each_size(backend, caplog):
    runner = compiled(backend)
    with caplog.at_level(logging.WARNING, logger="devgraph.strategies.adaptive"):
        report = runner.capture()  # before: CaptureError "FailOnRecompileLimitHit: Hard failure ..."
    info = runner.inspect()
    assert info["compile"] == "per_shape" and info["fallback_kind"] == "recompile_limit"
    assert "specialises on the batch size" in info["fallback_cause"]
    assert info["static_compiles"] >= 1 and info["fallback_seconds"] > 0
    assert any("static shapes" in note for note in report.notes)
    assert "static shapes" in report.table()
    assert any("compiling each size with static shapes" in r.getMessage() for r in caplog.records)
    for n in (1, 3, 7, 10):
        x = torch.randn(n, 4)
        result = runner.verify(x=x)
        assert result.replayed and result.ok and result.max_abs_diff == 0
        torch.testing.assert_close(runner.run(x=x), per_size(x))
    assert runner.inspect()["recompiles"] == 0  # verify() reuses the compile of its size


def test_a_forward_no_compile_can_trace_is_refused_naming_both_causes():
    runner = compiled("full", untraceable, sizes=[1, 2])
    with pytest.raises(CaptureError) as caught:
        runner.capture()
    message = str(caught.value)
    assert "one compile across sizes failed (graph_break" in message
    assert "so did a compile of this size with static shapes (the same error)" in message
    assert "@devgraph.graph_break op" in message and caught.value.cause == "torch_compile"
    assert not runner.keys  # nothing half-captured stays


def test_a_branch_on_a_tensor_value_is_refused_with_advice_about_the_value():
    runner = compiled("full", reads_a_value, sizes=[1, 2])
    # .item() traced into the graph (a user's config): dynamo then meets the branch on its value
    with (
        torch._dynamo.config.patch(capture_scalar_outputs=True),
        pytest.raises(CaptureError, match="data-dependent") as caught,
    ):
        runner.capture()
    assert "decides a shape or a branch from a value read out of a tensor" in str(caught.value)


def test_a_plain_forward_keeps_one_dynamic_compile():
    runner = compiled("full", lambda x: torch.tanh(x) * 2)
    runner.capture()
    info = runner.inspect()
    assert info["compile"] == "dynamic" and info["compiles"] == 1 and "fallback_kind" not in info
    assert runner.report is not None and not runner.report.notes


def test_an_error_of_the_forward_itself_is_reported_with_its_own_message():
    assert compile_error_kind(RuntimeError("shape mismatch")) is None  # raised by running code: no fallback
    compiled_fn = AdaptiveCompile(lambda x: x.view(3, 5), lambda gm, ex: gm, "probe")
    with pytest.raises(CaptureError) as caught:
        compiled_fn(torch.ones(4, 2))
    assert "shape '[3, 5]' is invalid for input of size 8" in str(caught.value)
    assert "run the forward eagerly on these shapes" in str(caught.value)


def test_a_fast_path_region_that_specialises_compiles_each_shape():
    region = CompiledRegion(per_size, "eager", CpuSimPlatform(), dynamic_args=1)
    for n in SIZES:
        x = torch.randn(n, 4)
        torch.testing.assert_close(region(x), per_size(x))
    described = region.describe()
    assert described["compile"] == "per_shape" and described["fallback_kind"] == "recompile_limit"


# -- a break op whose result is not shaped like its first argument, traced with the default fake (issue 27) --
@devgraph.graph_break("adaptive_test::first_three")
def first_three(x: torch.Tensor) -> torch.Tensor:
    return x[:, :3] * 2


@devgraph.graph_break("adaptive_test::first_three_faked", fake=lambda x: x.new_empty(x.shape[0], 3))
def first_three_faked(x: torch.Tensor) -> torch.Tensor:  # the advice's own example, applied
    return x[:, :3] * 2


PROJECT = torch.linspace(-1, 1, 6).reshape(3, 2)


def projects(x: torch.Tensor) -> torch.Tensor:
    return first_three(torch.relu(x)) @ PROJECT  # the code after the op traces on the fake's [n, 4] guess


def projects_faked(x: torch.Tensor) -> torch.Tensor:
    return first_three_faked(torch.relu(x)) @ PROJECT


def test_a_default_fake_of_the_wrong_shape_gets_advice_naming_fake():
    runner = GraphRunner(
        projects, phase="prefill", inputs=INPUTS, device="cpu", sizes=[2, 4], mode="tc_piecewise"
    )
    with pytest.raises(CaptureError) as raised:
        runner.capture()
    message = str(raised.value)
    what_to_do = message.split("What to do:")[1]
    assert "adaptive_test::first_three was traced with the default fake" in what_to_do
    assert "fake=lambda x: x.new_empty(x.shape[0], 3)" in what_to_do
    assert raised.value.cause == "break_op_fake"  # type: ignore[attr-defined]

    fixed = GraphRunner(
        projects_faked, phase="prefill", inputs=INPUTS, device="cpu", sizes=[2, 4], mode="tc_piecewise"
    )
    fixed.capture()
    x = torch.randn(3, 4)
    torch.testing.assert_close(fixed.run(x=x), projects_faked(x))


def test_a_static_compiles_signature_never_reads_a_tensors_values(monkeypatch):
    """An H200 run: a regional compile of the reference decoder failed to capture, because the signature
    of its arguments took ``repr`` of the paged-attention metadata (an unhashable dataclass of tensors),
    which formats each tensor with ``.item()``: a host sync inside the capture. Tensors nested in
    dataclasses, tuples, lists and dicts count by shape, dtype and device; their values are never read."""
    from dataclasses import dataclass

    from devgraph.strategies.adaptive import _signature

    @dataclass
    class Meta:  # unhashable (eq without frozen), tensors inside, as PagedMetadata
        lengths: torch.Tensor
        tables: list[torch.Tensor]
        extra: dict[str, torch.Tensor]

    def meta(rows: int) -> Meta:
        return Meta(torch.arange(rows), [torch.zeros(rows, 4)], {"slots": torch.ones(rows)})

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor's value was read")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "__repr__", refuse)
    x = torch.zeros(3, 8)
    first = _signature((x, meta(3)), {"frozen": (torch.ones(2),)})
    assert first == _signature((torch.ones(3, 8), meta(3)), {"frozen": (torch.zeros(2),)})  # other values
    assert first != _signature((x, meta(5)), {"frozen": (torch.ones(2),)})  # a nested shape differs
    assert first != _signature((x, meta(3)), {"frozen": (torch.ones(3),)})
    hash(first)


def test_a_signature_of_arguments_that_refer_to_themselves_ends():
    """A list holding itself, or a dataclass whose field points back at it (metadata linked to its
    owner), had a signature through ``repr`` before nested containers were walked (repr stops at a
    cycle); the walk must stop there too rather than raise RecursionError inside a capture."""
    from dataclasses import dataclass

    from devgraph.strategies.adaptive import _signature

    @dataclass
    class Node:
        rows: torch.Tensor
        parent: Node | None = None

    looped: list = [torch.zeros(2)]
    looped.append(looped)
    node = Node(torch.zeros(3))
    node.parent = node
    sig = _signature((looped, node), {"again": node})
    hash(sig)
    assert sig == _signature((looped, node), {"again": node})
    other = Node(torch.zeros(5))
    other.parent = other
    assert sig != _signature((looped, other), {"again": other})  # the nested shape still counts
    shared = torch.zeros(4)
    assert _signature(([shared, shared],), {}) == _signature(([torch.ones(4), torch.ones(4)],), {})
