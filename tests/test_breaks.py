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
