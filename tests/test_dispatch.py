"""Deciding per step: which key replays (request buckets per token size, variants) or why a step runs
eagerly."""

from __future__ import annotations

import pytest
import torch

from devgraph import ConfigError, GraphRunner, InputError, StaticInput, is_capturing
from devgraph.contract.keys import Batch, GraphKey
from devgraph.runner.dispatch import Decision, Dispatcher, EagerReason, FallbackReason, KeySet, Readiness
from devgraph.runner.schedule import KeySchedule

TOKEN_SIZES = (4, 8, 16)


def schedule(requests=None, **kwargs) -> KeySchedule:
    axes = {"requests": requests} if requests is not None else None
    return KeySchedule("prefill", TOKEN_SIZES, ["tokens", "requests"], axes, **kwargs)


def buckets(s: KeySchedule) -> dict[int, tuple[int, ...]]:
    return {t: s.buckets[t]["requests"] for t in s.token_sizes}


@pytest.mark.parametrize(
    ("requests", "expected"),
    [
        (None, {4: (4,), 8: (8,), 16: (16,)}),  # default: at most as many requests as tokens
        (6, {4: (4,), 8: (6,), 16: (6,)}),  # an int maximum
        ([1, 2, 4], {4: (1, 2, 4), 8: (1, 2, 4), 16: (1, 2, 4)}),  # one list for every token size
        ({4: [1, 4], 8: [2, 8], 16: [16, 4, 4]}, {4: (1, 4), 8: (2, 8), 16: (4, 16)}),  # per token size
        (lambda t: [1, t // 2], {4: (1, 2), 8: (1, 4), 16: (1, 8)}),  # a function of the token size
    ],
    ids=["default", "int", "list", "mapping", "callable"],
)
def test_request_buckets_per_token_size(requests, expected):
    s = schedule(requests)
    assert buckets(s) == expected
    keys = s.keys()
    assert keys == sorted(keys, key=GraphKey.sort_key, reverse=True)  # largest first
    assert {k.tokens for k in keys} == set(TOKEN_SIZES)
    assert len(keys) == sum(len(b) for b in expected.values())
    assert s.max_rows() == {"tokens": 16, "requests": max(max(b) for b in expected.values())}
    assert s.describe()["axes"] == {"requests": {str(t): list(b) for t, b in expected.items()}}


@pytest.mark.parametrize(
    ("requests", "fragment"),
    [
        (0, "a maximum must be a positive int"),
        ([], "non-empty list of positive ints"),
        ([1, 0], "non-empty list of positive ints"),
        ({4: [1], 8: [2]}, "no entry for token size 16"),
        (lambda t: None, "must be a list of positive ints"),
        ("many", "non-empty list of positive ints"),
    ],
)
def test_bad_request_buckets_are_config_errors(requests, fragment):
    with pytest.raises(ConfigError) as info:
        schedule(requests)
    assert fragment in str(info.value)


def test_axes_for_an_axis_no_input_uses():
    with pytest.raises(ConfigError, match=r"names \['pages'\], which no StaticInput uses"):
        KeySchedule("prefill", TOKEN_SIZES, ["tokens"], {"pages": 4})


def route(d: Dispatcher, tokens: int, requests: int, **variant) -> Decision:
    return d.route({"tokens": tokens, "requests": requests}, variant)


def test_route_picks_the_smallest_key_that_holds_every_count():
    d = Dispatcher(schedule({4: [1, 2], 8: [2, 8], 16: [4, 16]}))
    assert route(d, 3, 1).key == GraphKey.of(4, {"requests": 1})
    assert route(d, 4, 2).key == GraphKey.of(4, {"requests": 2})
    assert route(d, 3, 3).key == GraphKey.of(8, {"requests": 8})  # too many requests for tokens=4
    assert route(d, 9, 3).key == GraphKey.of(16, {"requests": 4})
    assert route(d, 16, 16).key == GraphKey.of(16, {"requests": 16})
    assert route(d, 17, 1) == Decision(None, EagerReason.PAST_LARGEST)
    assert route(d, 12, 17) == Decision(None, EagerReason.AXIS_PAST_LARGEST)


def test_decide_is_a_function_of_the_step_the_readiness_and_the_key_sets():
    d = Dispatcher(schedule([2, 4]))
    counts = {"tokens": 3, "requests": 2}
    key = GraphKey.of(4, {"requests": 2})
    captured = {key}
    primary = KeySet(captured.__contains__)
    ready = Readiness(None)
    assert d.decide(counts, {}, Readiness(EagerReason.DISABLED), [primary]).reason is EagerReason.DISABLED
    before = Readiness(EagerReason.BEFORE_CAPTURE)
    assert d.decide(counts, {}, before, [primary]).reason is EagerReason.BEFORE_CAPTURE
    assert d.decide(counts, {}, ready, [primary]) == Decision(key)
    step = Batch(3, counts=counts)
    declining = KeySet(captured.__contains__, veto=lambda batch: batch.context != "decline")
    assert d.decide(counts, {}, ready, [declining]) == Decision(key)  # no step: no veto asked
    assert d.decide(counts, {}, ready, [declining], step, "decline").reason is EagerReason.BACKEND_DECLINED
    assert d.decide(counts, {}, ready, [declining], step, "fine") == Decision(key)
    assert d.decide(counts, {}, ready, [declining, primary], step, "decline") == Decision(
        key, fallback=FallbackReason.BACKEND_DECLINED
    )
    captured.clear()
    assert d.decide(counts, {}, ready, [primary]).reason is EagerReason.NOT_CAPTURED
    capturing = Readiness(None, EagerReason.CAPTURING)
    assert d.decide(counts, {}, capturing, [primary]).reason is EagerReason.CAPTURING
    assert d.decide(counts, {}, ready, [primary, KeySet({key}.__contains__)]) == Decision(
        key, fallback=FallbackReason.NOT_CAPTURED
    )


def test_variants_are_part_of_the_key():
    d = Dispatcher(KeySchedule("decode", (1, 2, 4), ["tokens"], variants={"lora": (False, True)}))
    assert d.route({"tokens": 3}, {"lora": True}).key == GraphKey.of(4, variant={"lora": True})
    assert d.route({"tokens": 3}, {"lora": False}).key == GraphKey.of(4, variant={"lora": False})
    assert d.route({"tokens": 3}, {"lora": None}).reason is EagerReason.VARIANT_NOT_CAPTURED
    assert d.route({"tokens": 5}, {"lora": True}).reason is EagerReason.PAST_LARGEST


@pytest.mark.parametrize(
    ("variants", "fragment"),
    [
        ({"lora": ()}, "needs at least one value"),
        ({"requests": (1,)}, "identifier that is not an axis"),
        ({"not valid": (1,)}, "identifier that is not an axis"),
        ({"mask": ([1], [2])}, "must be hashable"),
        ({"lora": True}, "takes the values to capture"),
        ({"kind": "ab"}, "takes the values to capture"),
    ],
)
def test_bad_variants_are_config_errors(variants, fragment):
    with pytest.raises(ConfigError) as info:
        KeySchedule("prefill", TOKEN_SIZES, ["tokens", "requests"], variants=variants)
    assert fragment in str(info.value)


# -- variants through a runner --------------------------------------------------------------------------
class LoraForward:
    def __init__(self) -> None:
        self.captured: list[tuple[int, object]] = []

    def __call__(self, x: torch.Tensor, lora: object) -> torch.Tensor:
        if is_capturing():
            self.captured.append((x.shape[0], lora))
        return x * 2 + (1 if lora else 0)


def test_each_declared_variant_is_captured_and_chosen_per_step():
    fn = LoraForward()
    runner = GraphRunner(
        fn,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (2,))},
        device="cpu",
        mode="full",
        sizes=[1, 2],
        variants={"lora": (False, True)},
    )
    runner.capture()
    assert sorted(fn.captured) == [(1, False), (1, True), (2, False), (2, True)]
    x = torch.ones(2, 2)
    torch.testing.assert_close(runner.run(x=x, variant={"lora": True}), x * 2 + 1)
    torch.testing.assert_close(runner.run(x=x, variant={"lora": False}), x * 2)
    torch.testing.assert_close(runner.run(x=x, variant={"lora": 2}), x * 2 + 1)  # not declared: eager
    stats = runner.stats()
    assert stats["replays_by_key"] == {"tokens=2,lora=False": 1, "tokens=2,lora=True": 1}
    assert stats["eager_by_reason"]["variant_not_captured"] == 1
    with pytest.raises(InputError, match=r"missing \['lora'\]"):
        runner.run(x=x)
    with pytest.raises(InputError, match=r"unexpected \['rank'\]"):
        runner.run(x=x, variant={"lora": True, "rank": 8})


def test_a_variant_named_like_an_input_is_a_config_error():
    with pytest.raises(ConfigError, match=r"variants \['lora'\] share their names with inputs"):
        GraphRunner(
            lambda lora: lora,
            phase="decode",
            inputs={"lora": StaticInput(torch.float32)},
            device="cpu",
            sizes=[1, 2],
            variants={"lora": (False, True)},
        )


def test_bucket_reports_the_padded_token_size():
    runner = GraphRunner(
        lambda x: x,
        phase="decode",
        inputs={"x": StaticInput(torch.float32)},
        device="cpu",
        sizes=[1, 2, 4, 8],
    )
    assert runner.bucket(3) is None  # before capture every step runs eagerly
    runner.capture()
    assert [runner.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [runner.bucket(n) for n in (0, -5)] == [None, None]


def test_variant_values_that_compare_equal_are_refused():
    with pytest.raises(ConfigError, match="compare equal"):
        GraphRunner(
            lambda x, lora: x,
            phase="decode",
            inputs={"x": StaticInput(torch.float32)},
            device="cpu",
            sizes=[1, 2],
            variants={"lora": (1, True)},
        )
