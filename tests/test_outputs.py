"""Output structures and ownership: every path returns the same types and shapes for the same ``n``.

Outputs are pytrees (dataclasses, frozen too and with ``init=False`` fields, namedtuples, nested
containers, Hugging Face ``ModelOutput``); which leaves are row-major is declared (``output_axes=``) or
learned at capture, never guessed per step. Ownership: default outputs of a replay alias the graph's
static outputs; ``copy=True`` outputs alias nothing the runner owns; ``out=`` fills the caller's tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils import _pytree as pytree

from devgraph import CaptureError, ConfigError, GraphRunner, InputError, StaticInput
from devgraph.runner.outputs.trees import tensor_leaves
from devgraph.strategies import FullGraphBackend

SIZES = [1, 2, 4]
INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0)}
W = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10
BIAS = torch.arange(4, dtype=torch.float32)  # as long as the bucket of 4: not row-major all the same


@dataclasses.dataclass
class Plain:
    logits: torch.Tensor
    bias: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: torch.Tensor
    hidden: torch.Tensor
    total: torch.Tensor = dataclasses.field(init=False)  # derived in __post_init__, not an __init__ argument
    tag: str = dataclasses.field(init=False, default="frozen")

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.logits.sum(dim=1))


class Pair(NamedTuple):
    rows: torch.Tensor
    bias: torch.Tensor


class LookAlike(OrderedDict):
    """A Hugging Face ``ModelOutput`` look-alike: an OrderedDict that is also a dataclass, registered as a
    pytree node by its library (as transformers registers ``ModelOutput``)."""

    def __init__(self, logits: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__(logits=logits, bias=bias)

    @property
    def logits(self) -> torch.Tensor:
        return self["logits"]


pytree.register_pytree_node(
    LookAlike,
    lambda o: (list(o.values()), list(o.keys())),
    lambda values, keys: LookAlike(**dict(zip(keys, values, strict=True))),
    flatten_with_keys_fn=lambda o: ([(pytree.MappingKey(k), v) for k, v in o.items()], list(o.keys())),
    serialized_type_name="tests.test_outputs.LookAlike",
)


def f_tensor(x):
    return x @ W


def f_plain(x):
    return Plain(x @ W, BIAS.clone())


def f_frozen(x):
    return Frozen(x @ W, x * 2)


def f_namedtuple(x):
    return Pair(x @ W, BIAS + 0)


def f_nested(x):
    return {"a": [x @ W, (x.sum(dim=1), BIAS * 2)], "b": {"c": x[:, :2] + 1}, "n": 7}


def f_lookalike(x):
    return LookAlike(x @ W, BIAS + 1)


FORWARDS = {
    "tensor": f_tensor,
    "dataclass": f_plain,
    "frozen dataclass": f_frozen,
    "namedtuple": f_namedtuple,
    "nested": f_nested,
    "ModelOutput look-alike": f_lookalike,
}


def runner_on(path: str, fn, **kwargs) -> GraphRunner:
    mode = "disabled" if path == "disabled" else kwargs.pop("mode", "full")
    runner = GraphRunner(fn, phase="decode", inputs=INPUTS, device="cpu", mode=mode, sizes=SIZES, **kwargs)
    if path != "before_capture":
        runner.capture()
    return runner


def describe(tree: Any) -> Any:
    """The structure of an output with every tensor replaced by its dtype and shape."""
    leaves, spec = pytree.tree_flatten(tree)
    return spec, [(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in leaves]


def x_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(FORWARDS))
def test_every_path_returns_the_same_type_and_shapes(name):
    fn = FORWARDS[name]
    runners = {path: runner_on(path, fn) for path in ("graph", "before_capture", "disabled")}
    for n in (1, 3, 4, 6):  # a captured size, a padded one, the largest, past the largest
        x = x_of(n)
        expected = fn(x.clone())
        for path, runner in runners.items():
            got = runner.run(x=x)
            assert type(got) is type(expected), (path, n)
            assert describe(got) == describe(expected), (path, n)
            for a, b in zip(tensor_leaves(got), tensor_leaves(expected), strict=True):
                torch.testing.assert_close(a, b)
    assert runners["graph"].stats()["replays"] == 3 and runners["graph"].stats()["eager"] == 1


def test_frozen_dataclass_keeps_its_init_false_fields():
    runner = runner_on("graph", f_frozen)
    out = runner.run(x=x_of(3))
    assert isinstance(out, Frozen) and out.tag == "frozen"
    assert out.logits.shape == (3, 3) and out.hidden.shape == (3, 4)
    assert out.total.shape == (3,)  # an init=False tensor is cut like any other row-major leaf
    torch.testing.assert_close(out.total, out.logits.sum(dim=1))
    assert runner.inspect()["outputs"]["row_axes"][".total"] == "tokens"


def test_auxiliary_vector_as_long_as_a_bucket_is_never_cut():
    runner = runner_on("graph", f_namedtuple)
    assert runner.inspect()["outputs"]["row_axes"] == {".rows": "tokens", ".bias": None}
    for n in (1, 2, 3, 4, 5):
        assert runner.run(x=x_of(n)).bias.shape == (4,)


def test_single_size_runner_probes_another_size_to_learn_the_layout():
    calls = []

    def fn(x):
        calls.append(x.shape[0])
        return x @ W, BIAS + 0

    runner = GraphRunner(fn, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[4])
    runner.capture()
    assert calls[-1] == 3  # the probe, after the captures of 4 (warm-ups + capture)
    rows, bias = runner.run(x=x_of(2))
    assert rows.shape == (2, 3) and bias.shape == (4,)


def test_declared_output_axes_as_a_list_and_as_a_mapping():
    calls = []

    def fn(x):
        calls.append(x.shape[0])
        return {"rows": x @ W, "bias": BIAS + 0}

    by_list = GraphRunner(
        fn, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[4], output_axes=["tokens", None]
    )  # leaves in pytree order: 'rows', 'bias'
    by_map = GraphRunner(
        fn,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="full",
        sizes=[4],
        output_axes={"['rows']": "tokens"},
    )
    for runner in (by_list, by_map):
        calls.clear()
        runner.capture()
        assert 3 not in calls  # declared: no probe run
        out = runner.run(x=x_of(2))
        assert out["rows"].shape == (2, 3) and out["bias"].shape == (4,)
        assert runner.inspect()["outputs"] == {
            "leaves": 2,
            "row_axes": {"['rows']": "tokens", "['bias']": None},
            "declared": True,
        }


@pytest.mark.parametrize(
    ("declared", "fragment"),
    [
        (["tokens"], "has 1 entries but the forward returns 2 leaves"),
        ({"['nope']": "tokens"}, "not output leaves"),
        (["requests", None], "names axes ['requests']"),
        ("tokens", "must be a list"),
        (["tokens+x", None], "must be an axis name"),
    ],
)
def test_bad_output_axes_are_config_errors(declared, fragment):
    def fn(x):
        return {"rows": x @ W, "bias": BIAS + 0}

    with pytest.raises(ConfigError) as info:
        GraphRunner(
            fn, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[2, 4], output_axes=declared
        ).capture()
    assert fragment in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hugging_face_model_output_round_trips_as_its_own_type():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def fn(x):
        return CausalLMOutputWithPast(logits=x @ W, hidden_states=(x * 2,))

    runner = runner_on("graph", fn)
    for n in (1, 3, 6):
        x = x_of(n)
        out = runner.run(x=x)
        assert type(out) is CausalLMOutputWithPast and out.loss is None
        torch.testing.assert_close(out.logits, x @ W)
        assert out.hidden_states[0].shape == (n, 4)
    assert runner.verify(x=x_of(3)).ok


# -- verify() over output structures ------------------------------------------------------------------
class StaleReplay(FullGraphBackend):
    """A broken backend that hands back the captured outputs without replaying the graph."""

    def replay(self, key, static_inputs):
        return self._entries[key].outputs


@pytest.mark.parametrize(
    "name", ["dataclass", "frozen dataclass", "namedtuple", "nested", "ModelOutput look-alike"]
)
def test_verify_compares_every_leaf_and_catches_a_stale_graph(name):
    from devgraph import resolve_platform

    fn = FORWARDS[name]
    good = runner_on("graph", fn)
    result = good.verify(x=x_of(3, seed=1))
    assert result.ok and result.replayed
    assert result.leaves == len(tensor_leaves(fn(x_of(3))))
    stale = runner_on("graph", fn, backend=StaleReplay(resolve_platform("cpu"), phase="decode"))
    result = stale.verify(x=x_of(3, seed=1))
    assert result.replayed and not result.ok and result.max_abs_diff > 0


def test_verify_is_not_ok_without_tensor_leaves():
    runner = runner_on("graph", lambda x: {"count": 3, "name": "none"})
    result = runner.verify(x=x_of(2))
    assert result.leaves == 0 and not result.ok


def test_verify_compares_plain_leaves_too():
    # A graph returns the Python values of its capture: a count taken from the padded size is stale.
    runner = runner_on("graph", lambda x: {"rows": x @ W, "count": x.shape[0]})
    assert runner.run(x=x_of(3))["count"] == 4
    assert not runner.verify(x=x_of(3)).ok
    assert runner.verify(x=x_of(4)).ok


def test_verify_structure_mismatch_is_not_ok():
    from devgraph.runner.verify import compare

    a = {"x": torch.ones(2)}
    result = compare(2, None, a, a, {"y": torch.ones(2)}, None)
    assert not result.structure_matches and not result.ok


# -- ownership ------------------------------------------------------------------------------------------
def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensor_leaves(tree) if t.numel()}


def _owned_by_runner(runner: GraphRunner) -> set[int]:
    """Storages of the static inputs and of every graph's static outputs (a full-size step returns them)."""
    owned = {t.untyped_storage().data_ptr() for t in runner.static_inputs.values()}
    for key in runner.keys:
        owned |= _storages(runner.run(x=x_of(key.tokens, seed=9)))
    return owned


def test_default_outputs_alias_the_graphs_static_outputs():
    runner = runner_on("graph", f_nested)
    first = runner.run(x=x_of(3, seed=1))
    assert _storages(first) <= _owned_by_runner(runner)
    first = runner.run(x=x_of(4, seed=1))
    kept = tensor_leaves(first)[0].clone()
    runner.run(x=x_of(4, seed=2))
    assert not torch.equal(tensor_leaves(first)[0], kept)  # the next run overwrote it, as documented


@pytest.mark.parametrize("path", ["graph", "before_capture", "disabled"])
@pytest.mark.parametrize("n", [2, 3, 6])
def test_copy_outputs_never_alias_the_runner(path, n):
    runner = runner_on(path, f_nested)
    out = runner.run(x=x_of(n, seed=1), copy=True)
    kept = [t.clone() for t in tensor_leaves(out)]
    assert not _storages(out) & _owned_by_runner(runner)
    runner.run(x=x_of(n, seed=2))
    runner.run(x=x_of(4, seed=3))
    assert all(torch.equal(a, b) for a, b in zip(tensor_leaves(out), kept, strict=True))


@pytest.mark.parametrize("path", ["graph", "before_capture", "disabled"])
@pytest.mark.parametrize("n", [2, 3, 6])
def test_out_fills_the_callers_tensors_in_another_dtype(path, n):
    runner = runner_on(path, f_namedtuple)
    x = x_of(n)
    out = Pair(torch.full((n, 3), -1.0, dtype=torch.float64), torch.empty(4, dtype=torch.float16))
    got = runner.run(x=x, out=out)
    assert got is out
    torch.testing.assert_close(out.rows, (x @ W).double())
    torch.testing.assert_close(out.bias, BIAS.half())
    skip = Pair(torch.zeros(n, 3), None)  # a None leaf skips that output
    assert runner.run(x=x, out=skip).bias is None


@pytest.mark.parametrize(
    ("out", "fragment"),
    [
        ((torch.empty(2, 3),), "must have the structure"),  # a tuple where the step returns one tensor
        ([torch.empty(2, 3)], "must have the structure"),
        ({"logits": torch.empty(2, 3)}, "must have the structure"),
        (torch.empty(3, 3), "has shape (2, 3)"),
        (torch.empty(2), "has shape (2, 3)"),
    ],
)
def test_bad_out_is_an_input_error_and_writes_nothing(out, fragment):
    runner = runner_on("graph", f_tensor)
    before = [t.clone() for t in tensor_leaves(out)]
    with pytest.raises(InputError) as info:
        runner.run(x=x_of(2), out=out)
    assert fragment in str(info.value)
    # torch.empty may hold NaN: compare bit patterns, not values (NaN != NaN).
    leaves = zip(tensor_leaves(out), before, strict=True)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in leaves if a.numel())


def pair_forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


@pytest.mark.parametrize(
    ("second", "fragment"),
    [
        (torch.zeros(1, 3).expand(2, 3), "share one memory location"),
        (torch.zeros(2, 3, requires_grad=True), "requires grad"),
    ],
    ids=["expanded", "requires_grad"],
)
def test_an_unwritable_out_leaf_is_refused_before_any_leaf_is_written(second, fragment):
    # before: the first leaf was overwritten, then copy_ raised a raw RuntimeError on the second
    runner = GraphRunner(
        pair_forward, phase="decode", inputs={"x": StaticInput(torch.float32, (3,))}, device="cpu"
    )
    first = torch.full((2, 3), 7.0)
    with pytest.raises(InputError, match=f"out= leaf 1 cannot be written: .*{fragment}.*nothing was written"):
        runner.run(x=torch.ones(2, 3), out=(first, second))
    assert torch.equal(first, torch.full((2, 3), 7.0))


def test_copy_and_out_together_is_an_input_error():
    runner = runner_on("graph", f_tensor)
    with pytest.raises(InputError, match="copy=True or out=, not both"):
        runner.run(x=x_of(2), copy=True, out=torch.empty(2, 3))
    assert runner.stats()["steps"] == 0


def test_bad_out_structure_inside_a_dataclass():
    runner = runner_on("graph", f_plain)
    with pytest.raises(InputError, match="must have the structure"):
        runner.run(x=x_of(2), out=Pair(torch.empty(2, 3), torch.empty(4)))
    with pytest.raises(InputError, match="leaf 1 is int"):
        runner.run(x=x_of(2), out=Plain(torch.empty(2, 3), 5))


def test_namedtuple_and_dict_keys_are_part_of_the_structure():
    other = collections.namedtuple("Other", "rows bias")
    runner = runner_on("graph", f_namedtuple)
    with pytest.raises(InputError, match="must have the structure"):
        runner.run(x=x_of(2), out=other(torch.empty(2, 3), torch.empty(4)))
    nested = runner_on("graph", lambda x: {"a": x @ W})
    with pytest.raises(InputError, match="must have the structure"):
        nested.run(x=x_of(2), out={"b": torch.empty(2, 3)})


@pytest.mark.parametrize("mode", ["full", "breakable", "tc_piecewise"])
def test_each_step_gets_a_fresh_container_so_editing_it_changes_no_later_step(mode):
    runner = GraphRunner(
        lambda x: {"logits": x * 2, "hidden": x + 1},
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode=mode,
        sizes=SIZES,
    )
    runner.capture()
    first = runner.run(x=torch.ones(4, 4))  # exactly a captured size: nothing cut
    first["logits"] = first["logits"].double()
    first.pop("hidden")
    second = runner.run(x=torch.full((4, 4), 5.0))
    assert set(second) == {"logits", "hidden"}
    torch.testing.assert_close(second["logits"], torch.full((4, 4), 10.0))


def test_dataclass_with_its_own_init_round_trips():
    @dataclasses.dataclass(frozen=True)
    class Scaled:
        logits: torch.Tensor

        def __init__(self, raw: torch.Tensor, scale: float) -> None:
            object.__setattr__(self, "logits", raw * scale)

    runner = GraphRunner(
        lambda x: Scaled(x, 3.0), phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES
    )
    runner.capture()
    out = runner.run(x=torch.ones(3, 4))
    assert isinstance(out, Scaled) and out.logits.shape == (3, 4)
    torch.testing.assert_close(out.logits, torch.full((3, 4), 3.0))


def test_declared_output_axes_that_contradict_the_captured_shapes_are_refused():
    table = torch.arange(10, dtype=torch.float32)
    runner = GraphRunner(
        lambda x: (x * 2, table * 1),
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="full",
        sizes=SIZES,
        output_axes=[None, "tokens"],  # swapped by mistake
    )
    with pytest.raises(CaptureError, match=r"output \[1\] .* output_axes says it follows tokens"):
        runner.capture()


def test_out_dict_with_the_same_keys_in_another_order():
    runner = GraphRunner(
        lambda x: {"a": x * 2, "b": x + 1},
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="full",
        sizes=SIZES,
    )
    runner.capture()
    out = {"b": torch.empty(3, 4), "a": torch.empty(3, 4)}
    runner.run(x=torch.ones(3, 4), out=out)
    torch.testing.assert_close(out["a"], torch.full((3, 4), 2.0))
    torch.testing.assert_close(out["b"], torch.full((3, 4), 2.0))


def test_verify_is_not_fooled_by_infinite_outputs():
    # A -inf mask in the logits must not scale the tolerance to infinity: a stale graph is still caught.
    state = {"bias": torch.zeros(4)}

    def forward(x: torch.Tensor) -> torch.Tensor:
        logits = x + state["bias"]
        return logits.masked_fill(torch.arange(4) == 0, float("-inf"))

    # The address guard would name the rebound tensor before verify() compares anything: off, to test verify.
    runner = GraphRunner(
        forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES, address_guard=False
    )
    runner.capture()
    assert runner.verify(x=torch.ones(3, 4)).ok
    state["bias"] = torch.full((4,), 100.0)  # rebound, not copied: the graph is stale
    result = runner.verify(x=torch.ones(3, 4))
    assert not result.ok and result.max_abs_diff == pytest.approx(100.0)
