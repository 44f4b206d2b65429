"""The reference model's configuration, weights, example batches, contexts, static inputs and runners
(devgraph/reference: config.py, inputs.py, runners.py); tiny preset, CPU. What the paged model computes is
tested in test_paged_model.py."""

from __future__ import annotations

import pytest
import torch

from devgraph.contract.keys import REQUESTS, TOKENS
from devgraph.errors import ConfigError
from devgraph.reference import (
    ATTENTION_MODES,
    PRESET_NAMES,
    ReferenceConfig,
    ReferenceModel,
    StepContext,
    batch_context,
    decode_context,
    decode_runner,
    make_decode_batch,
    make_prefill_batch,
    make_verify_batch,
    padding_fill,
    prefill_context,
    prefill_runner,
    reference_inputs,
    verify_runner,
)


@pytest.fixture
def model(tiny_config: ReferenceConfig) -> ReferenceModel:
    return ReferenceModel(tiny_config, device="cpu", seed=0)


def _slot(batch: dict[str, torch.Tensor], request: int, position: int, block_size: int) -> int:
    """The flat cache slot of ``position`` in ``request``, read from its block table."""
    return int(batch["block_tables"][request, position // block_size]) * block_size + position % block_size


# ---------------------------------------------------------------------------------------------- config


def test_presets() -> None:
    tiny = ReferenceConfig.preset("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.dtype) == (2, 64, torch.float32)
    assert (tiny.attention, tiny.kernels, tiny.block_size) == ("paged", "auto", 16)
    qwen = ReferenceConfig.preset("qwen3-0.6b", max_seq_len=512)
    assert (qwen.num_layers, qwen.vocab_size, qwen.dtype, qwen.max_seq_len) == (
        28,
        151936,
        torch.bfloat16,
        512,
    )
    assert qwen.hidden_size != qwen.num_heads * qwen.head_dim  # as in Qwen3: the projections carry it
    assert ReferenceConfig.preset("tiny", dtype="bf16").dtype == torch.bfloat16
    assert set(PRESET_NAMES) == {"tiny", "qwen3-0.6b"}
    assert set(ATTENTION_MODES) == {"paged", "sdpa"}


def test_paged_cache_geometry() -> None:
    tiny = ReferenceConfig.preset("tiny")
    assert tiny.max_blocks_per_request == tiny.max_seq_len // tiny.block_size
    # Enough blocks for max_requests full-length requests, plus the scratch block 0.
    assert tiny.total_blocks == 1 + tiny.max_requests * tiny.max_blocks_per_request
    assert ReferenceConfig.preset("tiny", num_blocks=9).total_blocks == 9
    assert ReferenceConfig.preset("tiny", max_seq_len=40).max_blocks_per_request == 3  # rounded up
    assert tiny.kv_groups == tiny.num_heads // tiny.num_kv_heads


def test_unknown_preset_lists_accepted_names() -> None:
    with pytest.raises(ConfigError, match="tiny.*qwen3-0.6b"):
        ReferenceConfig.preset("llama-70b")


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_kv_heads": 3}, "divisible"),
        ({"head_dim": 15}, "even"),
        ({"num_layers": 0}, "positive"),
        ({"dtype": torch.int32}, "floating"),
        ({"dtype": "fp8"}, "unknown dtype"),
        ({"hidden": 64}, "unknown ReferenceConfig field"),
        ({"block_size": 24}, "power of two >= 16"),
        ({"block_size": 8}, "power of two >= 16"),
        ({"num_blocks": 1}, "num_blocks must be an int >= 2"),
        ({"attention": "flash"}, "attention 'flash' is unknown; accepted: paged, sdpa"),
        ({"kernels": "cuda"}, "kernels 'cuda' is unknown; accepted: auto, triton, torch"),
    ],
)
def test_bad_config_raises(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ReferenceConfig.preset("tiny", **overrides)


# ---------------------------------------------------------------------------------------------- weights


def test_shapes_and_dtypes(model: ReferenceModel, tiny_config: ReferenceConfig) -> None:
    c = tiny_config
    cache_shape = (c.total_blocks, c.block_size, c.num_kv_heads, c.head_dim)
    assert len(model.k_cache) == len(model.v_cache) == c.num_layers
    assert all(t.shape == cache_shape and t.dtype == c.dtype for t in (*model.k_cache, *model.v_cache))
    assert model.padding_slot == 0  # in the scratch block 0, which no request owns
    assert all(not p.requires_grad for p in model.parameters())
    # The caches are buffers outside the state dict: it holds the weights only.
    assert not any("cache" in name for name in model.state_dict())


def test_same_seed_same_weights(tiny_config: ReferenceConfig) -> None:
    a, b, c = (ReferenceModel(tiny_config, seed=s).state_dict() for s in (7, 7, 8))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])


def test_cache_is_zero_until_randomized_and_clear_cache_zeroes_it(model: ReferenceModel) -> None:
    caches = [*model.k_cache, *model.v_cache]
    assert all(not t.any() for t in caches)  # zeros, never uninitialised memory
    model.randomize_cache(seed=3)
    first = [t.clone() for t in caches]
    assert all(t.std() > 0.5 for t in first)
    model.randomize_cache(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first, caches, strict=True))  # reproducible
    model.clear_cache()
    assert all(not t.any() for t in caches)


# ---------------------------------------------------------------------------------------------- batches


def test_decode_batch_layout(model: ReferenceModel, tiny_config: ReferenceConfig) -> None:
    c = tiny_config
    batch = make_decode_batch(model, 4, seq_lens=[1, 16, 17, 40], seed=1)
    assert {n: (tuple(t.shape), t.dtype) for n, t in batch.items()} == {
        "input_ids": ((4,), torch.int64),
        "positions": ((4,), torch.int64),
        "slot_mapping": ((4,), torch.int64),
        "block_tables": ((4, c.max_blocks_per_request), torch.int32),
        "seq_lens": ((4,), torch.int32),
    }
    assert batch["seq_lens"].tolist() == [1, 16, 17, 40]
    assert batch["positions"].tolist() == [0, 15, 16, 39]  # the new token is the last of each sequence
    tables = batch["block_tables"]
    for r, length in enumerate([1, 16, 17, 40]):
        blocks = -(-length // c.block_size)
        assert (tables[r, :blocks] > 0).all() and not tables[r, blocks:].any()  # block 0 never owned
        assert int(batch["slot_mapping"][r]) == _slot(batch, r, length - 1, c.block_size)
    owned = tables[tables > 0].tolist()
    assert len(owned) == len(set(owned))  # every request has blocks of its own
    assert make_decode_batch(model, 3, seq_lens=9)["seq_lens"].tolist() == [9, 9, 9]
    random_lens = make_decode_batch(model, 16, seed=2)["seq_lens"]
    assert ((random_lens >= 1) & (random_lens <= c.max_seq_len)).all() and random_lens.unique().numel() > 1


def test_prefill_and_verify_batch_layout(model: ReferenceModel, tiny_config: ReferenceConfig) -> None:
    bs = tiny_config.block_size
    batch = make_prefill_batch(model, [3, 5], prefix_lens=[0, 20], seed=4)
    assert batch["positions"].tolist() == [0, 1, 2, 20, 21, 22, 23, 24]
    assert batch["cu_seqlens_q"].tolist() == [0, 3, 8] and batch["cu_seqlens_q"].dtype == torch.int32
    assert batch["seq_lens"].tolist() == [3, 25]  # prefix + new tokens
    request = [0, 0, 0, 1, 1, 1, 1, 1]
    expected = [_slot(batch, r, p, bs) for r, p in zip(request, batch["positions"].tolist(), strict=True)]
    assert batch["slot_mapping"].tolist() == expected

    verify = make_verify_batch(model, 3, 4, seed=5)
    assert verify["cu_seqlens_q"].tolist() == [0, 4, 8, 12]
    first = verify["positions"].view(3, 4)[:, 0]
    assert torch.equal(verify["positions"].view(3, 4), first[:, None] + torch.arange(4))
    assert torch.equal(verify["seq_lens"].long(), first + 4)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: make_decode_batch(m, m.config.max_requests + 1), "batch_size must be in"),
        (lambda m: make_decode_batch(m, 0), "batch_size must be in"),
        (lambda m: make_decode_batch(m, 2, seq_lens=[0, 4]), "must be ints in"),
        (lambda m: make_decode_batch(m, 2, seq_lens=[3]), "1 entries for a batch of 2"),
        (lambda m: make_prefill_batch(m, [3, m.config.max_seq_len + 1]), "must be ints in"),
        (lambda m: make_prefill_batch(m, [4], prefix_lens=[m.config.max_seq_len]), "prefix \\+ query"),
        (lambda m: make_prefill_batch(m, [4, 4], prefix_lens=[1]), "one length >= 0 per request"),
        (lambda m: make_prefill_batch(m, [1] * (m.config.max_requests + 1)), "takes up to"),
        (lambda m: make_verify_batch(m, 2, m.config.max_seq_len + 1), "exceeds max_seq_len"),
    ],
)
def test_bad_batches_raise(model: ReferenceModel, make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        make(model)


def test_a_batch_larger_than_the_cache_is_refused() -> None:
    small = ReferenceModel(ReferenceConfig.preset("tiny", num_blocks=4), seed=0)
    with pytest.raises(ConfigError, match="needs 4 KV blocks but the cache has 3"):
        make_decode_batch(small, 2, seq_lens=[32, 32])


# ---------------------------------------------------------------------------------------------- contexts


def test_contexts_carry_the_host_lengths(model: ReferenceModel) -> None:
    decode = make_decode_batch(model, 3, seq_lens=[5, 10, 2])
    assert batch_context(decode) == StepContext(seq_lens=[5, 10, 2], cu_seqlens_q=None)
    prefill = make_prefill_batch(model, [3, 5], prefix_lens=[1, 0])
    assert batch_context(prefill) == StepContext(seq_lens=[4, 5], cu_seqlens_q=[0, 3, 8])
    assert all(isinstance(n, int) for n in batch_context(prefill).seq_lens or [])
    # The old names are the same function now.
    assert decode_context is batch_context and prefill_context is batch_context


# ---------------------------------------------------------------------------------------------- inputs


def test_static_inputs_per_axis_and_their_fills(model: ReferenceModel) -> None:
    fill = padding_fill(model)
    assert fill == {
        "input_ids": 0,
        "positions": 0,
        "slot_mapping": model.padding_slot,
        "block_tables": 0,
        "seq_lens": 0,
        "cu_seqlens_q": "edge",
    }
    decode = reference_inputs(model, "decode")
    assert set(decode) == {"input_ids", "positions", "slot_mapping", "block_tables", "seq_lens"}
    for phase in ("prefill", "verify"):
        packed = reference_inputs(model, phase)
        assert set(packed) == {*decode, "cu_seqlens_q"}
        cu = packed["cu_seqlens_q"]
        assert (cu.axis, cu.extra_rows, cu.fill, cu.dtype) == (REQUESTS, 1, "edge", torch.int32)
    axes = {name: spec.axis for name, spec in decode.items()}
    assert axes == {
        "input_ids": TOKENS,
        "positions": TOKENS,
        "slot_mapping": TOKENS,
        "block_tables": REQUESTS,
        "seq_lens": REQUESTS,
    }
    assert decode["block_tables"].shape == (model.config.max_blocks_per_request,)
    assert all(spec.fill == fill[name] for name, spec in decode.items())
    assert not any(spec.host for spec in decode.values())  # device metadata: capturable whole
    # A batch matches its static inputs: dtypes and row shapes.
    batch = make_prefill_batch(model, [2, 3])
    packed = reference_inputs(model, "prefill")
    assert all(batch[n].dtype == s.dtype and tuple(batch[n].shape[1:]) == s.shape for n, s in packed.items())


# ---------------------------------------------------------------------------------------------- runners


def test_runners_wire_each_step_to_its_phase(model: ReferenceModel) -> None:
    with decode_runner(model, mode="disabled") as runner:
        assert (runner.phase, runner.device, runner.tokens_per_request) == ("decode", model.device, 1)
        assert runner.forward == model.decode_step
        batch = make_decode_batch(model, 3)
        assert runner.run(**batch).shape == (3, model.config.vocab_size)
    with prefill_runner(model, mode="disabled", sizes=[16, 128]) as runner:
        assert runner.forward == model.prefill_step
        # At most max_requests requests per step: one request bucket per token size.
        assert runner.schedule.buckets[128][REQUESTS] == (model.config.max_requests,)
        assert runner.schedule.buckets[16][REQUESTS] == (16,)
        batch = make_prefill_batch(model, [2, 3])
        assert runner.run(**batch).shape == (2, model.config.vocab_size)
    with verify_runner(model, 4, mode="disabled", sizes=[4, 8]) as runner:
        assert (runner.forward, runner.tokens_per_request) == (model.verify_step, 4)
        batch = make_verify_batch(model, 2, 4)
        assert runner.run(**batch).shape == (8, model.config.vocab_size)
