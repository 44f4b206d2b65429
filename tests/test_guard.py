"""The address guard: every way a graph's memory can move is named before a replay, updates in place keep
the graphs valid, and ``refresh()`` captures again on the new tensors."""

from __future__ import annotations

import dataclasses
import functools
import gc

import pytest
import torch
from torch import nn

from devgraph import GraphRunner, StaticInput
from devgraph.errors import ReplayError
from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner, make_decode_batch
from devgraph.runner.guard import AddressGuard, observe, reach

INPUTS = {"x": StaticInput(torch.float32, (4,))}
SIZES = [2, 4]


@pytest.fixture
def decode(tiny_model):
    runner = decode_runner(tiny_model, mode="full", sizes=[1, 2, 4], progress=False)
    runner.capture()
    yield runner
    runner.close()


def step(model, runner, n=3, seed=0):
    batch = make_decode_batch(model, n, seq_lens=5, seed=seed)
    return runner.run(**batch)


def test_the_guard_watches_every_weight_and_cache_of_the_reference_model(decode, tiny_model):
    described = decode.inspect()["address_guard"]
    expected = len(list(tiny_model.parameters())) + len(list(tiny_model.buffers()))
    assert described["watched"] == expected and described["named"] == expected
    assert (
        described["per_step_links"] == 0
    )  # all reached through module attributes: torch's hooks report them
    step(tiny_model, decode)  # nothing moved: replays


def test_weights_replaced_are_named(decode, tiny_model):
    layer = tiny_model.layers[0]
    layer.o_proj = nn.Parameter(layer.o_proj.detach().clone(), requires_grad=False)
    with pytest.raises(ReplayError, match=r"ReferenceModel\.layers\.0\.o_proj .* was replaced.*refresh\(\)"):
        step(tiny_model, decode)
    with pytest.raises(ReplayError, match="o_proj"):  # stays stale until refresh()
        step(tiny_model, decode)
    assert decode.run(**make_decode_batch(tiny_model, 8, seq_lens=5)) is not None  # eager steps still run


def test_weights_swapped_under_the_same_parameter_are_named(decode, tiny_model):
    tiny_model.layers[1].down_proj.data = tiny_model.layers[1].down_proj.data.clone()  # what .to() does
    # On a device the old storage is freed (an event, seen by the next step); the simulator's graph still
    # views it, so here the full check shows it.
    with pytest.raises(ReplayError, match=r"layers\.1\.down_proj .* is on other memory now"):
        decode.check_addresses()


def test_a_kv_cache_recreated_is_named(decode, tiny_model):
    layer = tiny_model.layers[1]
    layer.v_cache = torch.zeros_like(layer.v_cache)
    with pytest.raises(ReplayError, match=r"layers\.1\.v_cache \(\[.*\] float32\) was replaced"):
        step(tiny_model, decode)


def test_a_kv_cache_freed_is_named(decode, tiny_model):
    tiny_model.layers[0].k_cache = None
    with pytest.raises(ReplayError, match=r"layers\.0\.k_cache .* is gone"):
        step(tiny_model, decode)


def test_what_no_event_reports_is_found_by_the_full_check(decode, tiny_model):
    del tiny_model.layers[1].v_cache  # no torch hook runs on a delete
    step(tiny_model, decode)
    with pytest.raises(ReplayError, match=r"layers\.1\.v_cache .* is gone"):
        decode.check_addresses()


def test_a_layer_replaced_is_named(decode, tiny_model):
    tiny_model.layers[1] = type(tiny_model.layers[1]).__new__(type(tiny_model.layers[1]))
    nn.Module.__init__(tiny_model.layers[1])
    with pytest.raises(ReplayError, match=r"ReferenceModel\.layers\.1 is another object now"):
        step(tiny_model, decode)


def test_updates_in_place_keep_the_graphs_valid(decode, tiny_model):
    reference = step(tiny_model, decode).clone()
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    with torch.no_grad():
        tiny_model.layers[0].o_proj.mul_(2.0)
        tiny_model.layers[0].k_cache.add_(0.5)
    changed = step(tiny_model, decode).clone()
    assert not torch.equal(changed, reference)
    tiny_model.load_state_dict(state)  # copies in place
    with torch.no_grad():
        tiny_model.layers[0].k_cache.sub_(0.5)
    torch.testing.assert_close(step(tiny_model, decode), reference)


def test_refresh_captures_again_on_the_new_tensors(decode, tiny_model):
    new = tiny_model.layers[0].o_proj.detach() * 3.0
    tiny_model.layers[0].o_proj = nn.Parameter(new, requires_grad=False)
    with pytest.raises(ReplayError):
        step(tiny_model, decode)
    report = decode.refresh()
    assert [k.key.tokens for k in report.keys] == [1, 2, 4]
    batch = make_decode_batch(tiny_model, 3, seq_lens=5)
    result = decode.verify(**batch)
    assert result.replayed and result.ok
    step(tiny_model, decode)
    assert decode.stats()["replays"] == 1


def test_refresh_hands_out_the_new_graphs_outputs():
    state = {"w": torch.ones(4)}

    def forward(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": x * state["w"], "z": x + 1}

    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES)
    runner.capture()
    runner.run(x=torch.ones(2, 4))
    state["w"] = torch.full((4,), 3.0)
    runner.refresh()
    out = runner.run(x=torch.ones(2, 4))
    torch.testing.assert_close(out["y"], torch.full((2, 4), 3.0))


class Engine:
    """An engine object holding its model and its runner, whose method is the runner's forward."""

    def __init__(self) -> None:
        self.weight = torch.ones(4)
        self.runner = GraphRunner(
            self.step, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES
        )

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_devgraphs_own_objects_reached_from_the_forward_are_not_watched():
    engine = Engine()
    engine.runner.capture()
    engine.runner.run(x=torch.ones(2, 4))
    assert engine.runner.inspect()["address_guard"]["watched"] == 1  # the weight; not the runner's buffers
    engine.runner.refresh()  # walks again, past the guard's own bookkeeping: nothing to report
    engine.runner.run(x=torch.ones(2, 4))
    engine.weight = torch.ones(4)
    with pytest.raises(ReplayError, match=r"Engine\.weight .* was replaced"):
        engine.runner.run(x=torch.ones(2, 4))


def test_closure_lists_and_dicts_are_checked_every_step():
    caches = [torch.ones(4)]
    scratch = {"bias": torch.zeros(4)}

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * caches[0] + scratch["bias"]

    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES)
    runner.capture()
    assert runner.inspect()["address_guard"]["per_step_links"] == 4  # two cells, a list item, a dict item
    runner.run(x=torch.ones(2, 4))
    caches[0] = torch.ones(4)  # the engine re-created its cache
    with pytest.raises(ReplayError, match=r"forward\.caches\[0\] .* was replaced"):
        runner.run(x=torch.ones(2, 4))
    caches[0] = runner.inspect() and caches[0]
    runner.refresh()
    runner.run(x=torch.ones(2, 4))
    scratch.pop("bias")  # a buffer freed
    with pytest.raises(ReplayError, match=r"forward\.scratch\['bias'\] is gone"):
        runner.run(x=torch.ones(2, 4))


def test_a_rebound_closure_variable_is_named():
    weight = torch.ones(4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * weight

    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode="breakable", sizes=SIZES)
    runner.capture()
    weight = torch.full((4,), 2.0)  # noqa: F841 - the closure's cell now holds another tensor
    with pytest.raises(ReplayError, match=r"forward\.weight is another object now"):
        runner.run(x=torch.ones(2, 4))


def test_an_unnamed_tensor_freed_is_named_by_its_facts():
    # On a device the graph holds no reference: the last one gone frees the memory. The guard sees that.
    held = [torch.ones(3, 4)]
    found = observe(lambda: torch.ones(2, 4) @ held[0].T)
    guard = AddressGuard("decode")
    guard.arm(reach(lambda: None), found, set())
    guard.check()
    held.clear()
    del found
    gc.collect()
    with pytest.raises(
        ReplayError, match=r"an unnamed tensor \[3, 4\] float32 \(first used by aten\..*\) was freed"
    ):
        guard.check()


def test_the_runners_own_buffers_and_temporaries_are_not_watched():
    weight = torch.ones(4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        tmp = x * 2
        return tmp + weight

    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES)
    runner.capture()
    assert runner.inspect()["address_guard"]["watched"] == 1  # the weight only


def test_the_guard_can_be_turned_off_and_costs_nothing_then():
    state = {"w": torch.ones(4)}

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * state["w"]

    runner = GraphRunner(
        forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES, address_guard=False
    )
    runner.capture()
    state["w"] = torch.full((4,), 2.0)
    assert torch.equal(runner.run(x=torch.ones(2, 4)), torch.ones(2, 4))  # stale, as documented: no guard
    assert runner.inspect()["address_guard"] is None


def test_a_lazily_capturing_runner_is_guarded_from_its_first_capture():
    state = {"w": torch.ones(4)}

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * state["w"]

    runner = GraphRunner(
        forward, phase="encode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES, lazy=True
    )
    runner.capture()
    runner.run(x=torch.ones(2, 4))
    assert runner.inspect()["address_guard"]["watched"] == 1
    state["w"] = torch.ones(4)
    with pytest.raises(ReplayError, match=r"forward\.state\['w'\]"):
        runner.run(x=torch.ones(2, 4))


@pytest.mark.parametrize(("warmups", "runs"), [(0, 0), (1, 1), (2, 2), (3, 3)])
def test_the_observed_run_is_the_first_warm_up_or_one_more_with_a_single_warm_up(warmups, runs):
    # The first key's first warm-up runs under the observing mode; with one warm-up only, the observed run
    # comes before it (a compiled forward still runs compiled once before its capture); with none, nothing
    # is observed and the guard watches the reachable module tensors only. The counter is state the forward
    # does not declare, so the state probe shares the observed run and undoes its own extra one: the counter
    # moves exactly as many runs as were asked for.
    calls = torch.zeros((), dtype=torch.int64)

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.add_(1)
        return x * 2

    runner = GraphRunner(
        forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[4], warmup_iters=warmups,
        output_axes=["tokens"],  # no layout probe: only warm-ups and the observed run move the counter
    )  # fmt: skip
    runner.capture()
    assert calls.item() == runs
    assert runner.inspect()["address_guard"]["watched"] == (0 if warmups == 0 else 1)


@pytest.mark.parametrize(("warmups", "calls"), [(0, 0), (1, 1 + 1), (2, 2), (3, 3)])
def test_the_forward_runs_once_more_than_asked_only_with_a_single_warm_up(warmups, calls):
    # Counted on the host, where no probe undoes a run: the observed run stands for a warm-up, except that
    # with one warm-up only the backend's own forward still runs once after it, before the capture.
    seen: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return x * 2

    runner = GraphRunner(
        forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[4], warmup_iters=warmups,
        output_axes=["tokens"],
    )  # fmt: skip
    runner.capture()
    assert len(seen) == calls + 1  # and the capture itself, which runs the forward once on the simulator


# -- on a GPU: the graph holds no reference, so a dropped tensor is freed memory --------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_on_a_gpu_every_case_is_caught_before_the_replay(mode):
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_seq_len=64), device="cuda", seed=0)
    runner = decode_runner(model, mode=mode, sizes=[1, 4], progress=False)
    runner.capture()
    batch = make_decode_batch(model, 3, seq_lens=5)
    runner.run(**batch)
    layer = model.layers[0]
    cases = {
        "weight replaced": lambda: setattr(
            layer, "o_proj", nn.Parameter(layer.o_proj.detach().clone(), False)
        ),
        "weight swapped": lambda: setattr(layer.down_proj, "data", layer.down_proj.detach().clone()),
        "kv cache re-created": lambda: setattr(layer, "k_cache", torch.zeros_like(layer.k_cache)),
        "buffer freed": lambda: setattr(layer, "v_cache", None),
    }
    for name, change in cases.items():
        change()
        with pytest.raises(ReplayError, match="changed since"):
            runner.run(**batch)
        # Every tensor the forward reaches now is new: capture again, and the step replays correctly.
        if name == "buffer freed":
            layer.v_cache = torch.zeros_like(layer.k_cache)
        runner.refresh()
        assert runner.verify(**batch).ok, name
    runner.close()


class GrowingTable:
    """Rebinds ``table`` when it grows and keeps the old one alive, so graphs captured on it stay correct."""

    __devgraph_rebinds__ = ("table",)

    def __init__(self) -> None:
        self.table = torch.ones(4)
        self.scale = torch.ones(4)
        self.retired: list[torch.Tensor] = []

    def grow(self) -> None:
        self.retired.append(self.table)
        self.table = torch.ones(8)[:4]


def test_an_attribute_rebound_on_purpose_is_not_reported():
    holder = GrowingTable()
    runner = GraphRunner(
        lambda x: x * holder.table * holder.scale,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="full",
        sizes=SIZES,
    )
    runner.capture()
    holder.grow()
    runner.run(x=torch.ones(2, 4))  # the graphs read the old table, which the holder keeps
    runner.check_addresses()
    holder.scale = torch.ones(4)  # not listed in __devgraph_rebinds__: reported
    with pytest.raises(ReplayError, match=r"holder\.scale .* was replaced"):
        runner.run(x=torch.ones(2, 4))


# -- every place a module can hold a tensor (issue 27) ---------------------------------------------------
class PrivateCache(nn.Module):
    """A module keeping its cache in a ``_``-named plain attribute (not a registered buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self._kv_cache = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self._kv_cache


@pytest.mark.parametrize("as_module", [False, True], ids=["bound_forward", "module"])
def test_a_cache_recreated_in_a_private_module_attribute_is_named(as_module):
    model = PrivateCache()
    forward = model if as_module else model.forward
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES)
    runner.capture()
    assert runner.inspect()["address_guard"]["named"] == 1
    model._kv_cache = torch.randn(4)  # what an engine's reset does; replaying would read the old cache
    with pytest.raises(ReplayError, match=r"PrivateCache\._kv_cache \(\[4\] float32\) was replaced"):
        runner.run(x=torch.ones(2, 4))
    runner.refresh()
    torch.testing.assert_close(runner.run(x=torch.ones(2, 4)), torch.ones(2, 4) * model._kv_cache)


@dataclasses.dataclass(slots=True)
class SlottedHolder:
    cache: torch.Tensor


def test_a_cache_held_by_a_slotted_dataclass_is_named():
    holder = SlottedHolder(torch.ones(4))
    runner = GraphRunner(
        lambda x: x * holder.cache, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES
    )
    runner.capture()
    runner.run(x=torch.ones(2, 4))
    holder.cache = torch.randn(4)
    with pytest.raises(ReplayError, match=r"holder\.cache .* was replaced"):
        runner.run(x=torch.ones(2, 4))
    del holder.cache  # an emptied slot
    with pytest.raises(ReplayError, match=r"holder\.cache is gone"):
        runner.check_addresses()


#: Module globals a helper of the forward reads (a lazily made workspace, a cache table).
_WORKSPACE = torch.ones(4)
_TABLES = {"scale": torch.ones(4)}


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * _WORKSPACE + _TABLES["scale"]


class CallsHelpers(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._inner(x)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(x)


@pytest.mark.parametrize(
    "forward",
    [
        lambda x: _scaled(x),
        functools.partial(lambda x, k: _scaled(x) * k, k=1.0),
        CallsHelpers().forward,
        CallsHelpers(),
    ],
    ids=["closure_calls_helper", "partial", "method_calls_method", "module"],
)
def test_globals_a_helper_of_the_forward_reads_are_named(forward):
    global _WORKSPACE
    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES)
    runner.capture()
    assert runner.inspect()["address_guard"]["named"] == 2
    old = _WORKSPACE
    try:
        _WORKSPACE = torch.randn(4)  # the helper's workspace re-made (a library's lazily built buffer)
        with pytest.raises(ReplayError, match=r"_WORKSPACE \(\[4\] float32\) was replaced"):
            runner.run(x=torch.ones(2, 4))
        _WORKSPACE = old
        runner.check_addresses()
        _TABLES["scale"] = torch.randn(4)
        with pytest.raises(ReplayError, match=r"_TABLES\['scale'\] .* was replaced"):
            runner.run(x=torch.ones(2, 4))
    finally:
        _WORKSPACE, _TABLES["scale"] = old, torch.ones(4)


def test_what_the_guard_does_not_follow_is_listed():
    runner = GraphRunner(
        lambda x: x * 2, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=SIZES
    )
    runner.capture()
    described = runner.inspect()["address_guard"]
    assert described["complete"] is True
    assert any("properties" in line for line in described["not_followed"])


def test_the_walk_skips_standard_library_machinery_an_engine_holds():
    import logging
    import threading

    class Engine:
        def __init__(self) -> None:
            self.log = logging.getLogger("devgraph.test")
            self.lock = threading.Lock()
            self.weight = torch.ones(4)

        def step(self, x: torch.Tensor) -> torch.Tensor:
            with self.lock:
                return x * self.weight

    engine = Engine()
    found = reach(engine.step)
    assert found.complete and len(found.places) == 1


def test_the_storage_resize_watch_leaves_tensors_without_memory_alone():
    # torch.compile resizes the storages of meta and fake tensors while it traces (on CUDA, the RNG
    # functionalization makes one as its graph is compiled): reading their address fails there (torch
    # 2.11) or warns (later), so the watch passes them through untouched.
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from devgraph.runner.guard import events

    events.install()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            fake = torch.tensor(())
        fake.untyped_storage().resize_(0)
        torch.empty(4, device="meta").untyped_storage().resize_(0)
    before = events.epoch()
    real = torch.zeros(256)
    real.untyped_storage().resize_(0)  # real memory given back: still an event
    assert events.epoch() > before


def test_torch_compile_of_an_empty_tensor_works_once_a_guard_is_armed() -> None:
    """The guard's storage-resize hook is process-wide. torch.compile gives the fake tensor of an empty
    input (or constant) a zero-byte storage through ``resize_``, and a fake storage has no data pointer to
    read: the hook must let it through, not fail every later compile of the process."""
    from devgraph.runner.guard import events

    events.install()  # what arming any runner's guard does
    before = events.epoch()
    compiled = torch.compile(lambda x, y: x + y.sum(), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3), torch.empty(0)), torch.ones(3))
    assert events.epoch() == before  # a fake storage's resize is nothing a graph captured
    storage = torch.ones(4).untyped_storage()
    storage.resize_(64)  # a real storage moved to other memory is still an event
    assert events.epoch() > before
