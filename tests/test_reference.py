"""Tests of the reference model (devgraph/reference): tiny preset, CPU, fast."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from devgraph.breaks import is_break_target
from devgraph.context import forward_context
from devgraph.errors import ConfigError
from devgraph.reference import (
    PRESET_NAMES,
    ReferenceConfig,
    ReferenceModel,
    StepContext,
    attention,
    decode_context,
    make_decode_batch,
    make_prefill_batch,
    padding_fill,
    prefill_context,
)

# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def config() -> ReferenceConfig:
    return ReferenceConfig.preset("tiny")


def _model(config: ReferenceConfig, *, seed: int = 0, cache_seed: int | None = 0) -> ReferenceModel:
    model = ReferenceModel(config, device="cpu", seed=seed)
    if cache_seed is not None:
        model.randomize_cache(cache_seed)
    return model


@pytest.fixture
def model(config: ReferenceConfig) -> ReferenceModel:
    """A tiny model whose cache holds random history (a fresh one per test: steps write the cache)."""
    return _model(config)


@pytest.fixture
def twin(config: ReferenceConfig) -> ReferenceModel:
    """Same weights and same cache as ``model``."""
    return _model(config)


# ---------------------------------------------------------------------------------------------- helpers


def _caches(model: ReferenceModel) -> list[torch.Tensor]:
    return [*model.k_cache, *model.v_cache]


def _pad(batch: dict[str, torch.Tensor], fill: dict[str, int], size: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in batch.items():
        pad = torch.full((size - t.shape[0],), fill[name], dtype=t.dtype, device=t.device)
        out[name] = torch.cat([t, pad])
    return out


class _NoHostSync(TorchDispatchMode):
    """Fails on any op a device graph cannot capture: host syncs and data-dependent shapes."""

    FORBIDDEN = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func._schema.name
        assert name not in self.FORBIDDEN, f"{name} is not graph-capturable"
        if name in ("aten::index", "aten::index_put", "aten::index_put_"):
            indices = args[1]
            assert not any(i is not None and i.dtype == torch.bool for i in indices), "boolean-mask indexing"
        return func(*args, **kwargs)


class _RecordGraphs:
    """A ``torch.compile`` backend that behaves like ``eager`` and keeps the FX graphs it was given."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        self.graphs.append(gm)
        return gm.forward


# ---------------------------------------------------------------------------------------------- config


def test_presets() -> None:
    tiny = ReferenceConfig.preset("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.dtype) == (2, 64, torch.float32)
    qwen = ReferenceConfig.preset("qwen3-0.6b", max_seq_len=512)
    assert (qwen.num_layers, qwen.vocab_size, qwen.dtype, qwen.max_seq_len) == (
        28,
        151936,
        torch.bfloat16,
        512,
    )
    assert ReferenceConfig.preset("tiny", dtype="bf16").dtype == torch.bfloat16
    assert set(PRESET_NAMES) == {"tiny", "qwen3-0.6b"}


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
    ],
)
def test_bad_config_raises(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ReferenceConfig.preset("tiny", **overrides)


# ---------------------------------------------------------------------------------------------- model


def test_shapes_and_dtypes(model: ReferenceModel, config: ReferenceConfig) -> None:
    cache_shape = (config.max_requests + 1, config.max_seq_len, config.num_kv_heads, config.head_dim)
    assert len(model.k_cache) == len(model.v_cache) == config.num_layers
    assert all(c.shape == cache_shape and c.dtype == config.dtype for c in (*model.k_cache, *model.v_cache))
    assert model.padding_slot == config.max_requests

    batch = make_decode_batch(model, 6)
    assert all(t.shape == (6,) and t.dtype == torch.int64 for t in batch.values())
    logits = model.decode_step(**batch)
    assert logits.shape == (6, config.vocab_size) and logits.dtype == config.dtype
    assert torch.isfinite(logits).all()

    batch = make_prefill_batch(model, [3, 5])
    assert batch["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    hidden = model.prefill_step(**batch)
    assert hidden.shape == (8, config.hidden_size) and hidden.dtype == config.dtype
    assert model.compute_logits(hidden[[2, 7]]).shape == (2, config.vocab_size)


def test_bf16_stays_finite() -> None:
    model = _model(ReferenceConfig.preset("tiny", dtype=torch.bfloat16, num_layers=8))
    logits = model.decode_step(**make_decode_batch(model, 4))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_same_seed_same_weights(config: ReferenceConfig) -> None:
    a, b, c = (ReferenceModel(config, seed=s).state_dict() for s in (7, 7, 8))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])


def test_decode_ignores_cache_beyond_position(model: ReferenceModel, twin: ReferenceModel) -> None:
    batch = make_decode_batch(model, 8, seed=3)
    # In twin, replace every cache entry no row may see (other slots, later positions) by large noise.
    rows = torch.zeros(model.config.max_requests + 1, model.config.max_seq_len, dtype=torch.bool)
    for slot, pos in zip(batch["req_slots"].tolist(), batch["positions"].tolist(), strict=True):
        rows[slot, :pos] = True
    generator = torch.Generator().manual_seed(1)
    for cache in _caches(twin):
        noise = torch.randn(cache.shape, generator=generator) * 100
        cache.copy_(torch.where(rows[:, :, None, None], cache, noise))

    torch.testing.assert_close(twin.decode_step(**batch), model.decode_step(**batch), rtol=1e-5, atol=1e-5)


def test_decode_attends_to_history(model: ReferenceModel, twin: ReferenceModel) -> None:
    """Guards the test above against passing vacuously: visible history does matter."""
    batch = make_decode_batch(model, 4, seed=3)
    for cache in twin.k_cache:
        cache.mul_(-1)
    assert not torch.allclose(twin.decode_step(**batch), model.decode_step(**batch))


def test_packed_prefill_matches_separate_requests(model: ReferenceModel, twin: ReferenceModel) -> None:
    batch = make_prefill_batch(model, [3, 5], seed=2)
    packed = model.prefill_step(**batch)
    separate = torch.cat(
        [twin.prefill_step(**{name: t[s] for name, t in batch.items()}) for s in (slice(0, 3), slice(3, 8))]
    )
    torch.testing.assert_close(packed, separate, rtol=0, atol=1e-5)
    for a, b in zip(_caches(model), _caches(twin), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_prefill_writes_the_cache_decode_reads(model: ReferenceModel, twin: ReferenceModel) -> None:
    """Prefill of L tokens then decode of token L equals prefill of all L + 1 tokens."""
    batch = make_prefill_batch(model, [6], seed=4)
    full = model.prefill_step(**batch)
    twin.prefill_step(**{name: t[:5] for name, t in batch.items()})
    logits = twin.decode_step(**{name: t[5:] for name, t in batch.items()})
    torch.testing.assert_close(logits, model.compute_logits(full[5:]), rtol=0, atol=1e-5)


def test_decode_padding_rows_are_harmless(model: ReferenceModel, twin: ReferenceModel) -> None:
    batch = make_decode_batch(model, 5, seed=5)
    padded = _pad(batch, padding_fill(model), 8)
    assert padded["req_slots"][5:].eq(model.padding_slot).all()
    torch.testing.assert_close(
        twin.decode_step(**padded)[:5], model.decode_step(**batch), rtol=1e-5, atol=1e-5
    )
    live = slice(0, model.padding_slot)  # padding rows touched only the padding slot
    for a, b in zip(_caches(model), _caches(twin), strict=True):
        torch.testing.assert_close(a[live], b[live], rtol=1e-5, atol=1e-5)


def test_prefill_padding_rows_are_harmless(model: ReferenceModel, twin: ReferenceModel) -> None:
    batch = make_prefill_batch(model, [3, 5], seed=6)
    padded = _pad(batch, padding_fill(model), 12)
    torch.testing.assert_close(
        twin.prefill_step(**padded)[:8], model.prefill_step(**batch), rtol=1e-5, atol=1e-5
    )


def test_max_seq_len_context_trims_without_changing_decode(model: ReferenceModel) -> None:
    batch = make_decode_batch(model, 8, seed=7)
    context = decode_context(batch)
    assert context.max_seq_len == int(batch["positions"].max()) + 1 < model.config.max_seq_len
    full = model.decode_step(**batch)
    with forward_context(context):
        trimmed = model.decode_step(**batch)
    torch.testing.assert_close(trimmed, full, rtol=1e-5, atol=1e-5)
    # The context really is read: a window shorter than a position drops visible history.
    with forward_context(StepContext(max_seq_len=1)):
        assert not torch.allclose(model.decode_step(**batch), full)
    # Prefill ignores it.
    prefill = make_prefill_batch(model, [4, 2])
    expected = model.prefill_step(**prefill)
    with forward_context(StepContext(max_seq_len=1)):
        torch.testing.assert_close(model.prefill_step(**prefill), expected, rtol=0, atol=0)


def test_contexts_and_fill(model: ReferenceModel) -> None:
    batch = {"positions": torch.tensor([4, 9, 1])}
    assert decode_context(batch) == StepContext(max_seq_len=10, seq_lens=[5, 10, 2])
    assert prefill_context([3, 5]) == StepContext(max_seq_len=5, seq_lens=[3, 5])
    assert padding_fill(model) == {"input_ids": 0, "positions": 0, "req_slots": model.config.max_requests}
    with pytest.raises(ConfigError):
        make_decode_batch(model, model.config.max_requests + 1)
    with pytest.raises(ConfigError):
        make_prefill_batch(model, [3, model.config.max_seq_len + 1])


def test_steps_are_capturable(model: ReferenceModel) -> None:
    """No host sync or data-dependent shape in the steps, nor inside the attention op's body."""
    decode = make_decode_batch(model, 4)
    prefill = make_prefill_batch(model, [3, 5])
    with _NoHostSync():
        model.decode_step(**decode)
        model.prefill_step(**prefill)
    # A dispatch mode sees a custom op as one call; run the body itself to inspect its aten ops.
    c = model.config
    q = torch.randn(8, c.num_heads, c.head_dim)
    kv = torch.randn(8, c.num_kv_heads, c.head_dim)
    caches = model.k_cache[0], model.v_cache[0]
    with _NoHostSync():
        for is_prefill, batch in ((False, decode), (True, prefill)):
            n = batch["positions"].shape[0]
            attention.fn(q[:n], kv[:n], kv[:n], *caches, batch["req_slots"], batch["positions"], is_prefill)


def _naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query row ``[H, D]`` against ``[L, KVH, D]`` keys/values, head by head."""
    groups = q.shape[0] // keys.shape[1]
    heads = []
    for h in range(q.shape[0]):
        k, v = keys[:, h // groups], values[:, h // groups]
        weights = torch.softmax(k @ q[h] / q.shape[1] ** 0.5, dim=0)
        heads.append(weights @ v)
    return torch.stack(heads)


@pytest.mark.parametrize("is_prefill", [False, True])
def test_attention_matches_naive_loop(model: ReferenceModel, is_prefill: bool) -> None:
    c = model.config
    batch = make_prefill_batch(model, [3, 5], seed=8) if is_prefill else make_decode_batch(model, 6, seed=8)
    slots, positions = batch["req_slots"], batch["positions"]
    n = slots.shape[0]
    generator = torch.Generator().manual_seed(9)
    q = torch.randn(n, c.num_heads, c.head_dim, generator=generator)
    k = torch.randn(n, c.num_kv_heads, c.head_dim, generator=generator)
    v = torch.randn(n, c.num_kv_heads, c.head_dim, generator=generator)
    k_cache, v_cache = model.k_cache[0], model.v_cache[0]
    out = attention(q, k, v, k_cache, v_cache, slots, positions, is_prefill)
    assert out.shape == q.shape and out.is_contiguous()
    for i in range(n):
        slot, pos = int(slots[i]), int(positions[i])
        assert torch.equal(k_cache[slot, pos], k[i]) and torch.equal(v_cache[slot, pos], v[i])
        if is_prefill:
            seen = (slots == slot) & (positions <= pos)
            expected = _naive_attention(q[i], k[seen], v[seen])
        else:
            expected = _naive_attention(q[i], k_cache[slot, : pos + 1], v_cache[slot, : pos + 1])
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


def test_attention_op_registration(model: ReferenceModel) -> None:
    """Schema, mutation annotations and the fake (shape function) agree with the real op."""
    c = model.config
    batch = make_decode_batch(model, 3)
    args = (
        torch.randn(3, c.num_heads, c.head_dim),
        torch.randn(3, c.num_kv_heads, c.head_dim),
        torch.randn(3, c.num_kv_heads, c.head_dim),
        model.k_cache[0],
        model.v_cache[0],
        batch["req_slots"],
        batch["positions"],
        False,
    )
    torch.library.opcheck(
        torch.ops.devgraph_ref.attention.default, args, test_utils=("test_schema", "test_faketensor")
    )
    assert is_break_target(torch.ops.devgraph_ref.attention.default)


def test_torch_compile_keeps_one_attention_node_per_layer(model: ReferenceModel) -> None:
    torch._dynamo.reset()
    batch = make_decode_batch(model, 5)
    expected = model.decode_step(**batch)
    backend = _RecordGraphs()
    compiled = torch.compile(model.decode_step, backend=backend, dynamic=True, fullgraph=True)
    # Rewriting the same K/V at the same positions is idempotent, so the model can be reused.
    torch.testing.assert_close(compiled(**batch), expected, rtol=1e-6, atol=1e-6)
    # A second batch size runs without a recompile (dynamic shapes).
    other = make_decode_batch(model, 3, seed=1)
    torch.testing.assert_close(compiled(**other), model.decode_step(**other), rtol=1e-6, atol=1e-6)
    assert len(backend.graphs) == 1
    nodes = [
        n for n in backend.graphs[0].graph.nodes if n.op == "call_function" and is_break_target(n.target)
    ]
    assert len(nodes) == model.config.num_layers
    assert all(n.target is torch.ops.devgraph_ref.attention.default for n in nodes)
    torch._dynamo.reset()
