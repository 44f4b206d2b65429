"""graph_break: custom-op registration, handler routing, FX visibility."""

from __future__ import annotations

import pytest
import torch

from devgraph import BreakOp, ConfigError, graph_break
from devgraph.contract.breaks import break_handler, is_break_target


@graph_break
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@graph_break("devgraph_test::add_into", mutates_args=("acc",))
def add_into(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    acc.add_(x)
    return x + 1


def test_bare_decorator_makes_a_break_op():
    assert isinstance(double, BreakOp)
    assert double.name.startswith("devgraph_user::")
    torch.testing.assert_close(double(torch.ones(2)), torch.full((2,), 2.0))
    assert is_break_target(double.overload)


def test_named_op_with_mutation():
    acc = torch.zeros(3)
    out = add_into(torch.ones(3), acc)
    torch.testing.assert_close(acc, torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    assert add_into.name == "devgraph_test::add_into"


def test_handler_receives_calls_and_is_restored():
    calls = []

    def handler(op, args, kwargs):
        calls.append(op)
        return op.run_eager(args, kwargs) + 100

    with break_handler(handler):
        out = double(torch.ones(1))
    assert calls == [double] and out.item() == 102
    assert double(torch.ones(1)).item() == 2


def test_visible_to_torch_compile_as_one_node():
    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(lambda x: double(x.sin()).cos(), backend=backend, fullgraph=True)
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), double(x.sin()).cos())
    assert sum(is_break_target(t) for t in targets) == 1


def test_bad_name_and_missing_annotations():
    with pytest.raises(ConfigError, match="namespace::op_name"):
        graph_break("no_namespace")(lambda x: x)

    def unannotated(x):
        return x

    with pytest.raises(ConfigError, match="cannot register"):
        graph_break("devgraph_test::unannotated")(unannotated)


# -- break ops as real code uses them (under every strategy) -------------------------------------------
from devgraph import CaptureError, GraphRunner, StaticInput  # noqa: E402

MODES = {
    "full": {"mode": "full"},
    "full+compile": {"config": '{"decode": {"backend": "full", "compiler": "eager"}}'},
    "breakable": {"mode": "breakable"},
    "tc_piecewise": {"mode": "tc_piecewise"},
}


@graph_break("devgraph_test::triple")
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@graph_break("devgraph_test::outer_op")
def outer_op(x: torch.Tensor) -> torch.Tensor:
    return triple(x) + 1  # a break op inside a break op's body (vLLM's nested ops, an attention's indexer)


@graph_break("devgraph_test::write_into", mutates_args=("out",))
def write_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)  # the copy-free form: writes its result into an argument, returns nothing


@graph_break("devgraph_test::plus_minus")
def plus_minus(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x - 1


@graph_break("devgraph_test::first_two")
def first_two(x: torch.Tensor) -> torch.Tensor:
    return x[:, :2].clone()  # not shaped like its argument: the default fake cannot know that


def nested(x):
    return outer_op(x.sin()).cos()


def copy_free(x):
    out = torch.empty_like(x)
    write_into(x.sin(), out)
    return out.cos()


def pair(x):
    a, b = plus_minus(x.sin())
    return a * b


def narrower(x):
    return first_two(x.sin()).cos()


def runner_for(forward, mode: str) -> GraphRunner:
    inputs = {"x": StaticInput(torch.float32, (4,), fill=0.0)}
    return GraphRunner(forward, phase="decode", inputs=inputs, device="cpu", sizes=[1, 2], **MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("forward", [nested, copy_free, pair], ids=["nested", "copy_free", "tuple"])
def test_break_ops_nest_return_nothing_or_tuples_under_every_strategy(forward, mode):
    # before: breakable failed on the nested op ("nested capture" on the CPU); every compiling capture
    # failed on the copy-free form ("Expected __torch_dispatch__ ... to return None"), tc_piecewise on tuples
    runner = runner_for(forward, mode)
    runner.capture()
    x = torch.randn(2, 4)
    result = runner.verify(x=x)
    assert result.replayed and result.ok and result.max_abs_diff == 0
    torch.testing.assert_close(runner.run(x=x), forward(x))
    runner.close()


def test_nested_break_ops_are_one_break_under_breakable():
    runner = runner_for(nested, "breakable")
    runner.capture()
    assert all(k["break_ops"] == 1 for k in runner.inspect()["keys"].values())  # the inner op ran inside


@pytest.mark.parametrize("mode", ["full+compile", "tc_piecewise"])
def test_a_result_the_default_fake_gets_wrong_is_refused_naming_fake(mode):
    runner = runner_for(narrower, mode)
    with pytest.raises(CaptureError, match="Pass fake=") as caught:
        runner.capture()
    assert "returned (2, 2) torch.float32" in str(caught.value)
    assert caught.value.cause == "break_op_fake"


@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_modes_without_a_compiler_take_any_result_shape(mode):
    runner = runner_for(narrower, mode)
    runner.capture()
    x = torch.randn(2, 4)
    torch.testing.assert_close(runner.run(x=x), narrower(x))


def test_an_explicit_fake_fixes_the_shape():
    @graph_break("devgraph_test::first_two_faked", fake=lambda x: x.new_empty(x.shape[0], 2))
    def first_two_faked(x: torch.Tensor) -> torch.Tensor:
        return x[:, :2].clone()

    runner = runner_for(lambda x: first_two_faked(x.sin()).cos(), "tc_piecewise")
    runner.capture()
    assert runner.verify(x=torch.randn(2, 4)).ok


def test_a_python_scalar_result_is_refused_at_registration():
    # before: the int of the capture was replayed as a constant in every later step, silently
    def count_rows(x: torch.Tensor) -> int:
        return x.shape[0]

    with pytest.raises(ConfigError, match="Python int result: a graph replays the value"):
        graph_break("devgraph_test::count_rows")(count_rows)


def test_a_list_result_asks_for_fake_when_compiled():
    @graph_break("devgraph_test::halves")
    def halves(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[: x.shape[0] // 2].clone(), x[x.shape[0] // 2 :].clone()]

    runner = runner_for(lambda x: halves(x)[0].sum() + x, "tc_piecewise")
    with pytest.raises(CaptureError, match="returns List\\[Tensor\\]: torch.compile cannot guess") as caught:
        runner.capture()
    assert caught.value.cause == "break_op_fake"
