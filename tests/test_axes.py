"""Two-axis inputs (tokens and requests) padded on both axes, and the speculative-decoding verify phase."""

from __future__ import annotations

import logging

import pytest
import torch

from devgraph import ConfigError, GraphRunner, InputError, StaticInput

PACKED_INPUTS = {
    "ids": StaticInput(torch.int64, fill=0),
    "lens": StaticInput(torch.int32, axis="requests", fill=0),
    "cu": StaticInput(torch.int32, axis="requests", extra_rows=1, fill="edge"),
}


def packed(ids: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor) -> dict[str, torch.Tensor]:
    """A packed multi-request step computed from device metadata only (capturable as one graph)."""
    tokens, requests = ids.shape[0], lens.shape[0]
    positions = torch.arange(tokens, device=ids.device)
    request_of_token = torch.searchsorted(cu[1:].long(), positions, right=True).clamp(max=requests - 1)
    per_request = torch.zeros(requests, device=ids.device).index_add_(0, request_of_token, ids.float())
    return {
        "tokens": ids * 10 + request_of_token,
        "per_request": per_request + lens.float(),
        "cu": cu * 2,  # one row more than the requests: cut to requests + 1
    }


def batch(query_lens: list[int]) -> dict[str, torch.Tensor]:
    total = sum(query_lens)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "ids": torch.arange(1, total + 1),
        "lens": torch.tensor(query_lens, dtype=torch.int32) + 100,
        "cu": cu,
    }


def packed_runner(**kwargs) -> GraphRunner:
    kwargs.setdefault("sizes", [4, 8, 16])
    kwargs.setdefault("axes", {"requests": [2, 4]})
    runner = GraphRunner(packed, phase="prefill", inputs=PACKED_INPUTS, device="cpu", mode="full", **kwargs)
    runner.capture()
    return runner


@pytest.mark.parametrize("query_lens", [[3], [2, 3], [1, 1, 1], [4, 4, 4, 4], [5, 1, 2], [16]])
def test_packed_step_pads_both_axes_and_matches_eager(query_lens):
    runner = packed_runner()
    inputs = batch(query_lens)
    expected = packed(**{k: v.clone() for k, v in inputs.items()})
    got = runner.run(**inputs)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    tokens, requests = sum(query_lens), len(query_lens)
    (key,) = runner.stats()["replays_by_key"]  # the step replayed one graph, e.g. "tokens=8,requests=4"
    sizes = dict(part.split("=") for part in key.split(","))
    padded_tokens, padded_requests = int(sizes["tokens"]), int(sizes["requests"])
    assert padded_tokens >= tokens and padded_requests >= requests
    static = runner.static_inputs
    assert torch.all(static["ids"][tokens:padded_tokens] == 0)  # the tokens axis's fill
    assert torch.all(static["lens"][requests:padded_requests] == 0)  # the requests axis's fill
    # "edge": padded requests repeat the last cumulative length, so they hold zero tokens
    assert torch.all(static["cu"][requests + 1 : padded_requests + 1] == tokens)


def test_smallest_key_holding_both_counts_is_chosen():
    runner = packed_runner(axes={"requests": {4: [1, 2], 8: [2, 4], 16: [4, 8]}})
    cases = [
        ([2, 1], "tokens=4,requests=2"),
        ([1, 1, 1], "tokens=8,requests=4"),
        ([3], "tokens=4,requests=1"),
        ([1] * 5, "tokens=16,requests=8"),
        ([5, 5], "tokens=16,requests=4"),
    ]
    for query_lens, key in cases:
        runner.reset_stats()
        runner.run(**batch(query_lens))
        assert runner.stats()["replays_by_key"] == {key: 1}, query_lens


def test_eager_fallback_per_axis_is_counted_by_reason():
    runner = packed_runner()
    out = runner.run(**batch([1] * 6))  # 6 requests: past the largest request bucket (4)
    assert out["per_request"].shape == (6,) and out["cu"].shape == (7,)
    runner.run(**batch([10, 10]))  # 20 tokens: past the largest token size
    reasons = runner.stats()["eager_by_reason"]
    assert reasons["axis_past_largest"] == 1 and reasons["past_largest"] == 1
    assert runner.stats()["replays"] == 0


def test_outputs_following_each_axis_are_learned_and_cut():
    runner = packed_runner()
    assert runner.inspect()["outputs"]["row_axes"] == {
        "['tokens']": "tokens",
        "['per_request']": "requests",
        "['cu']": "requests+1",
    }
    out = runner.run(**batch([2, 1]))
    assert {k: tuple(v.shape) for k, v in out.items()} == {"tokens": (3,), "per_request": (2,), "cu": (3,)}


def test_default_request_buckets_equal_the_token_size_and_axes_are_told_apart():
    # Every key has as many requests as tokens, so only a probe at other sizes tells the axes apart.
    runner = packed_runner(axes=None)
    assert runner.schedule.describe()["axes"] == {"requests": {"4": [4], "8": [8], "16": [16]}}
    out = runner.run(**batch([2, 3]))
    assert {k: tuple(v.shape) for k, v in out.items()} == {"tokens": (5,), "per_request": (2,), "cu": (3,)}


def test_request_counts_must_match_the_request_inputs():
    runner = packed_runner()
    inputs = batch([2, 2])
    with pytest.raises(InputError, match=r"'cu'.*requests=2 \+ 1"):
        runner.run(**{**inputs, "cu": inputs["cu"][:2]})
    with pytest.raises(InputError, match="unknown axes"):
        runner.run(counts={"pages": 3}, **inputs)
    with pytest.raises(InputError, match=r"'lens'.*requests=3"):
        runner.run(counts={"requests": 3}, **inputs)


def test_engine_defined_axis():
    inputs = {"ids": StaticInput(torch.int64), "pages": StaticInput(torch.int32, axis="pages", fill=-1)}

    def forward(ids, pages):
        return ids + 1, pages * 2

    runner = GraphRunner(
        forward,
        phase="prefill",
        inputs=inputs,
        device="cpu",
        mode="full",
        sizes=[4, 8],
        axes={"pages": [3, 6]},
    )
    runner.capture()
    ids, pages = runner.run(ids=torch.arange(5), pages=torch.arange(4, dtype=torch.int32))
    assert ids.shape == (5,) and pages.tolist() == [0, 2, 4, 6]
    assert runner.stats()["replays_by_key"] == {"tokens=8,pages=6": 1}
    assert runner.static_inputs["pages"][4:6].tolist() == [-1, -1]


# -- the verify phase (speculative decoding: 1 + k tokens per request) ---------------------------------
VERIFY_INPUTS = {"ids": StaticInput(torch.int64), "lens": StaticInput(torch.int32, axis="requests")}


def verify_forward(ids: torch.Tensor, lens: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"logits": ids.float()[:, None] * 2, "per_request": lens.float() + 1}


def verify_runner(**kwargs) -> GraphRunner:
    return GraphRunner(
        verify_forward,
        phase="verify",
        inputs=VERIFY_INPUTS,
        device="cpu",
        mode="full",
        tokens_per_request=4,
        **kwargs,
    )


def test_verify_sizes_are_multiples_of_tokens_per_request():
    runner = verify_runner(sizes=[4, 8, 16])
    assert runner.sizes == (4, 8, 16)
    scheduled = runner.schedule.keys()  # largest first, the capture order
    assert [str(k) for k in scheduled] == [
        "tokens=16,requests=4",
        "tokens=8,requests=2",
        "tokens=4,requests=1",
    ]
    assert all(size % 4 == 0 for size in verify_runner(max_size=64).sizes)
    with pytest.raises(ConfigError, match="multiples of tokens_per_request=4"):
        verify_runner(sizes=[4, 6])


def test_verify_max_size_not_a_multiple_is_rounded_up_and_the_widest_batch_captured(caplog):
    with caplog.at_level(logging.WARNING, logger="devgraph.runner"):
        runner = verify_runner(max_size=10)
    assert runner.sizes[-1] == 12 and all(size % 4 == 0 for size in runner.sizes)
    assert any("capturing up to 12" in r.getMessage() for r in caplog.records)
    runner.capture()
    assert "tokens=12,requests=3" in {str(k) for k in runner.keys}
    out = runner.run(ids=torch.arange(12), lens=torch.ones(3, dtype=torch.int32))
    assert runner.stats()["replays_by_key"] == {"tokens=12,requests=3": 1}
    assert out["logits"].shape == (12, 1) and out["per_request"].shape == (3,)


def test_verify_step_pads_whole_requests_and_checks_n():
    runner = verify_runner(sizes=[4, 8, 16])
    runner.capture()
    out = runner.run(ids=torch.arange(12), lens=torch.tensor([1, 2, 3], dtype=torch.int32))
    assert runner.stats()["replays_by_key"] == {"tokens=16,requests=4": 1}
    assert out["logits"].shape == (12, 1) and out["per_request"].tolist() == [2.0, 3.0, 4.0]
    with pytest.raises(InputError, match="n must be a multiple of 4; got 6"):
        runner.run(6, ids=torch.arange(6), lens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(InputError, match="has 2 requests, not 3"):
        runner.run(counts={"requests": 3}, ids=torch.arange(8), lens=torch.ones(3, dtype=torch.int32))


def test_verify_phase_needs_tokens_per_request_and_other_phases_refuse_it():
    with pytest.raises(ConfigError, match="needs tokens_per_request"):
        GraphRunner(verify_forward, phase="verify", inputs=VERIFY_INPUTS, device="cpu", mode="full")
    with pytest.raises(ConfigError, match="use phase='verify'"):
        GraphRunner(
            verify_forward,
            phase="decode",
            inputs=VERIFY_INPUTS,
            device="cpu",
            mode="full",
            tokens_per_request=4,
        )
    with pytest.raises(ConfigError, match="do not pass axes"):
        verify_runner(axes={"requests": [1, 2]})
