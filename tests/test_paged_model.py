"""What the reference model computes over its paged KV cache, with both attention forms (tiny preset, CPU):

* ``paged``: the device-metadata kernels as custom ops (capturable whole; the kernels themselves are
  tested in test_kernels.py);
* ``sdpa``: a break op that reads host lengths from the forward context, or, with no lengths there,
  falls back to the device-metadata reference.

Steps are called as an engine calls them: an ``sdpa`` model gets the batch's host lengths as context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from devgraph.contract.breaks import is_break_target
from devgraph.contract.context import forward_context
from devgraph.contract.inputs import EDGE
from devgraph.reference import (
    ATTENTION_OP_NAME,
    PagedMetadata,
    ReferenceConfig,
    ReferenceModel,
    StepContext,
    batch_context,
    make_decode_batch,
    make_prefill_batch,
    make_verify_batch,
    reference_inputs,
    sdpa_attention,
)
from devgraph.reference.attention import paged_attention
from devgraph.reference.kernels import attention_backend

ATTENTIONS = ["paged", "sdpa"]
Batch = dict[str, torch.Tensor]

# ---------------------------------------------------------------------------------------------- helpers


def _model(attention: str = "paged", **overrides: object) -> ReferenceModel:
    """A tiny model (seed 0) whose cache holds random history (cache seed 0)."""
    model = ReferenceModel(ReferenceConfig.preset("tiny", attention=attention, **overrides), seed=0)
    model.randomize_cache(0)
    return model


def _step(model: ReferenceModel, phase: str, batch: Batch, context: object = "batch") -> torch.Tensor:
    """One step; ``context="batch"`` passes the batch's host lengths, as an engine does."""
    fn: Callable[..., torch.Tensor] = getattr(model, f"{phase}_step")
    with forward_context(batch_context(batch) if context == "batch" else context):
        return fn(**batch)


def _caches(model: ReferenceModel) -> list[torch.Tensor]:
    return [*model.k_cache, *model.v_cache]


def _visible_slots(model: ReferenceModel, batch: Batch) -> torch.Tensor:
    """``[total_blocks * block_size]`` bool: the slots a step may read (each request's first
    ``seq_lens[r]`` positions, through its block table)."""
    bs = model.config.block_size
    visible = torch.zeros(model.config.total_blocks * bs, dtype=torch.bool)
    for r, length in enumerate(batch["seq_lens"].tolist()):
        for p in range(length):
            visible[int(batch["block_tables"][r, p // bs]) * bs + p % bs] = True
    return visible


def _pad(model: ReferenceModel, phase: str, batch: Batch, tokens: int, requests: int) -> Batch:
    """Pad every input along its axis with its fill, as the runner's static buffers do."""
    out = {}
    for name, spec in reference_inputs(model, phase).items():
        t = batch[name]
        rows = spec.rows(tokens if spec.axis == "tokens" else requests) - t.shape[0]
        if spec.fill == EDGE:
            pad = t[-1:].expand(rows, *t.shape[1:])
        else:
            pad = torch.full((rows, *t.shape[1:]), spec.fill, dtype=t.dtype)
        out[name] = torch.cat([t, pad])
    return out


def _request(batch: Batch, r: int) -> Batch:
    """Request ``r`` of a packed batch as a batch of its own."""
    cu = batch["cu_seqlens_q"].tolist()
    tokens = slice(cu[r], cu[r + 1])
    return {
        "input_ids": batch["input_ids"][tokens],
        "positions": batch["positions"][tokens],
        "slot_mapping": batch["slot_mapping"][tokens],
        "block_tables": batch["block_tables"][r : r + 1],
        "seq_lens": batch["seq_lens"][r : r + 1],
        "cu_seqlens_q": torch.tensor([0, cu[r + 1] - cu[r]], dtype=torch.int32),
    }


class _NoHostSync(TorchDispatchMode):
    """Fails on any op a device graph cannot capture: host syncs and data-dependent shapes."""

    FORBIDDEN = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops.add(name)
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


# ---------------------------------------------------------------------------------------------- steps


def test_step_outputs(tiny_config: ReferenceConfig) -> None:
    model = _model()
    vocab = tiny_config.vocab_size
    logits = model.decode_step(**make_decode_batch(model, 6))
    assert logits.shape == (6, vocab) and logits.dtype == tiny_config.dtype and torch.isfinite(logits).all()
    assert model(**make_decode_batch(model, 2)).shape == (2, vocab)  # forward is decode_step
    prefill = make_prefill_batch(model, [3, 5])
    assert model.prefill_step(**prefill).shape == (2, vocab)  # each request's last token
    assert model.verify_step(**make_verify_batch(model, 3, 4)).shape == (12, vocab)  # every token


def test_verify_logits_are_the_logits_of_every_token() -> None:
    """verify_step's rows at each request's last token are prefill_step's logits for the same batch."""
    model, twin = _model(), _model()
    batch = make_verify_batch(model, 3, 4, seed=2)
    every = model.verify_step(**batch)
    last = twin.prefill_step(**batch)
    torch.testing.assert_close(every[3::4], last, rtol=0, atol=1e-5)


def test_bf16_stays_finite() -> None:
    model = _model(dtype=torch.bfloat16, num_layers=8)
    logits = model.decode_step(**make_decode_batch(model, 4))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_step_reads_only_its_own_blocks_below_its_length(attention: str, phase: str) -> None:
    """Every slot no request may see (other blocks, positions at or past a length, the scratch block)
    is replaced by NaN and huge noise in a twin: the outputs do not move."""
    model, twin = _model(attention), _model(attention)
    if phase == "decode":
        batch = make_decode_batch(model, 6, seq_lens=[5, 40, 17, 33, 1, 16], seed=3)
    else:
        batch = make_prefill_batch(model, [3, 5, 7], prefix_lens=[4, 30, 0], seed=3)
    hidden = ~_visible_slots(model, batch)
    generator = torch.Generator().manual_seed(1)
    for cache in _caches(twin):
        flat = cache.view(-1, *cache.shape[2:])
        noise = torch.randn(flat.shape, generator=generator) * 1e4
        noise[::7] = float("nan")
        flat[hidden] = noise[hidden]
    expected = _step(model, phase, batch)
    torch.testing.assert_close(_step(twin, phase, batch), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_decode_attends_to_history(attention: str) -> None:
    """Guards the test above against passing vacuously: visible history does matter."""
    model, twin = _model(attention), _model(attention)
    batch = make_decode_batch(model, 4, seed=3)
    for cache in twin.k_cache:
        cache.mul_(-1)
    assert not torch.allclose(_step(twin, "decode", batch), _step(model, "decode", batch))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_packed_prefill_matches_separate_requests(attention: str) -> None:
    """Packing requests (fresh prompts and later chunks of a chunked prefill alike) changes nothing."""
    model, twin = _model(attention), _model(attention)
    batch = make_prefill_batch(model, [3, 5, 9], prefix_lens=[0, 4, 20], seed=2)
    packed = _step(model, "prefill", batch)
    separate = torch.cat([_step(twin, "prefill", _request(batch, r)) for r in range(3)])
    torch.testing.assert_close(packed, separate, rtol=0, atol=1e-5)
    for a, b in zip(_caches(model), _caches(twin), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_prefill_writes_the_cache_decode_reads(attention: str) -> None:
    """Prefill of L tokens then decode of token L + 1 equals prefill of all L + 1 tokens; and a prompt
    prefilled in two chunks equals it too."""
    model, twin, chunked = _model(attention), _model(attention), _model(attention)
    batch = make_prefill_batch(model, [21], seed=4)
    whole = _step(model, "prefill", batch)

    def part(first: int, stop: int) -> Batch:
        return {
            **{n: batch[n][first:stop] for n in ("input_ids", "positions", "slot_mapping")},
            "block_tables": batch["block_tables"],
            "seq_lens": torch.tensor([stop], dtype=torch.int32),
            "cu_seqlens_q": torch.tensor([0, stop - first], dtype=torch.int32),
        }

    _step(twin, "prefill", part(0, 20))
    step = part(20, 21)
    del step["cu_seqlens_q"]
    torch.testing.assert_close(_step(twin, "decode", step), whole, rtol=0, atol=1e-5)
    _step(chunked, "prefill", part(0, 13))
    torch.testing.assert_close(_step(chunked, "prefill", part(13, 21)), whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize(
    ("phase", "tokens", "requests"), [("decode", 8, 8), ("prefill", 12, 4), ("verify", 12, 3)]
)
def test_padding_rows_are_harmless(attention: str, phase: str, tokens: int, requests: int) -> None:
    """Rows padded with each input's fill (as the runner pads) leave the real rows' outputs unchanged,
    write only the scratch block, and come out finite."""
    model, twin = _model(attention), _model(attention)
    if phase == "decode":
        batch = make_decode_batch(model, 5, seed=5)
    elif phase == "prefill":
        batch = make_prefill_batch(model, [3, 5], prefix_lens=[0, 9], seed=6)
    else:
        batch = make_verify_batch(model, 2, 4, seed=7)
    padded = _pad(model, phase, batch, tokens, requests)
    assert padded["slot_mapping"][-1] == model.padding_slot and padded["seq_lens"][-1] == 0
    # The context holds the real requests only, as an engine's scheduler knows them.
    out = _step(twin, phase, padded, batch_context(batch))
    expected = _step(model, phase, batch)
    torch.testing.assert_close(out[: expected.shape[0]], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()
    live = slice(1, None)  # every block but the scratch block 0
    for a, b in zip(_caches(model), _caches(twin), strict=True):
        torch.testing.assert_close(a[live], b[live], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- contexts


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_sdpa_reads_host_lengths_from_the_context_and_paged_ignores_it(phase: str) -> None:
    if phase == "decode":
        batch = make_decode_batch(_model(), 8, seed=7)
    else:
        batch = make_prefill_batch(_model(), [4, 2, 7], prefix_lens=[30, 0, 3], seed=7)
    paged = _step(_model("paged"), phase, batch, None)
    # Host lengths or none (the device-metadata reference): the same attention, rounded differently.
    with_context = _step(_model("sdpa"), phase, batch)
    torch.testing.assert_close(with_context, paged, rtol=1e-5, atol=1e-5)
    assert torch.equal(_step(_model("sdpa"), phase, batch, None), paged)  # same kernels, bit for bit
    # The context really is read: host lengths that disagree with the device ones change the result.
    wrong = batch_context(batch)
    assert wrong.seq_lens is not None
    wrong.seq_lens = [1] * len(wrong.seq_lens)
    assert not torch.allclose(_step(_model("sdpa"), phase, batch, wrong), paged, atol=1e-3)
    # The paged form never looks at the context.
    assert torch.equal(_step(_model("paged"), phase, batch, wrong), paged)


def test_sdpa_packed_step_without_host_offsets_says_what_it_needs() -> None:
    model = _model("sdpa")
    batch = make_prefill_batch(model, [3, 2])
    with pytest.raises(ValueError, match=r"context.cu_seqlens_q \(a list\)"):
        _step(model, "prefill", batch, StepContext(seq_lens=[3, 2]))


# ---------------------------------------------------------------------------------------------- attention


def _naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row ``[H, D]`` against ``[L, KVH, D]`` keys/values, head by head."""
    groups = q.shape[0] // keys.shape[1]
    heads = []
    for h in range(q.shape[0]):
        k, v = keys[:, h // groups], values[:, h // groups]
        heads.append(torch.softmax(k @ q[h] * scale, dim=0) @ v)
    return torch.stack(heads)


@pytest.mark.parametrize("form", ["paged", "sdpa-context", "sdpa-no-context"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_attention_writes_the_slots_and_matches_a_naive_loop(form: str, phase: str) -> None:
    model = _model()
    c = model.config
    if phase == "decode":
        batch = make_decode_batch(model, 6, seq_lens=[1, 7, 16, 17, 50, 3], seed=8)
        cu = None
    else:
        batch = make_prefill_batch(model, [3, 5, 1], prefix_lens=[0, 12, 40], seed=8)
        cu = batch["cu_seqlens_q"]
    n = batch["slot_mapping"].shape[0]
    generator = torch.Generator().manual_seed(9)
    q = torch.randn(n, c.num_heads, c.head_dim, generator=generator)
    k = torch.randn(n, c.num_kv_heads, c.head_dim, generator=generator)
    v = torch.randn(n, c.num_kv_heads, c.head_dim, generator=generator)
    k_cache, v_cache = model.k_cache[0], model.v_cache[0]
    scale = c.head_dim**-0.5
    tables, lens = batch["block_tables"], batch["seq_lens"]
    if form == "paged":
        meta = PagedMetadata(batch["slot_mapping"], tables, lens, cu)
        out = paged_attention("torch", q, k, v, k_cache, v_cache, meta, scale)
    else:
        context = batch_context(batch) if form == "sdpa-context" else None
        with forward_context(context):
            meta = PagedMetadata(batch["slot_mapping"], tables, lens, cu)
            out = sdpa_attention(q, k, v, k_cache, v_cache, meta.tensors(), scale)
    assert out.shape == q.shape and out.is_contiguous()

    flat_k = k_cache.view(-1, c.num_kv_heads, c.head_dim)
    flat_v = v_cache.view(-1, c.num_kv_heads, c.head_dim)
    slots = batch["slot_mapping"].tolist()
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    request = torch.arange(n) if cu is None else torch.bucketize(torch.arange(n), cu[1:], right=True)
    bs = c.block_size
    for i in range(n):
        r, pos = int(request[i]), int(batch["positions"][i])
        seen = [int(tables[r, p // bs]) * bs + p % bs for p in range(pos + 1)]  # causal: up to itself
        expected = _naive(q[i], flat_k[seen], flat_v[seen], scale)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


def test_the_steps_have_no_host_sync() -> None:
    """No host sync or data-dependent shape in the steps, in the kernel bodies, or in the sdpa op's body
    (its shapes follow host lengths, which is why it is a break op, but it never reads the device)."""
    model = _model()
    decode = make_decode_batch(model, 4)
    prefill = make_prefill_batch(model, [3, 5], prefix_lens=[2, 0])
    verify = make_verify_batch(model, 2, 3)
    with _NoHostSync() as guard:
        model.decode_step(**decode)
        model.prefill_step(**prefill)
        model.verify_step(**verify)
    assert {"devgraph_ref::paged_attention", "devgraph_ref::write_kv"} <= guard.ops
    # A dispatch mode sees a custom op as one call; run the bodies themselves to inspect their aten ops.
    c = model.config
    q = torch.randn(8, c.num_heads, c.head_dim)
    kv = torch.randn(8, c.num_kv_heads, c.head_dim)
    caches = model.k_cache[0], model.v_cache[0]
    kernels = attention_backend("torch")
    with _NoHostSync():
        for batch in (decode, prefill):
            n = batch["slot_mapping"].shape[0]
            kernels.write_kv(kv[:n], kv[:n], *caches, batch["slot_mapping"])
            meta = PagedMetadata(
                batch["slot_mapping"], batch["block_tables"], batch["seq_lens"], batch.get("cu_seqlens_q")
            )
            if meta.cu_seqlens_q is None:
                kernels.paged_decode_attention(q[:n], *caches, meta, 0.25)
            else:
                kernels.paged_prefill_attention(q[:n], *caches, meta, 0.25)
            args = (q[:n], kv[:n], kv[:n], *caches, meta.tensors(), 0.25)
            with forward_context(batch_context(batch)):  # host lists: read without a device sync
                sdpa_attention.fn(*args)
            sdpa_attention.fn(*args)  # no context: the device-metadata reference


def test_attention_op_registration() -> None:
    """Schemas, mutation annotations and fakes (shape functions) agree with the real ops; only the sdpa
    form is a break op."""
    model = _model()
    c = model.config
    caches = (model.k_cache[0], model.v_cache[0])
    scale = c.head_dim**-0.5
    ops = torch.ops.devgraph_ref
    for batch in (make_decode_batch(model, 3), make_prefill_batch(model, [2, 3])):
        n = batch["slot_mapping"].shape[0]
        q = torch.randn(n, c.num_heads, c.head_dim)
        kv = torch.randn(n, c.num_kv_heads, c.head_dim)
        meta = PagedMetadata(
            batch["slot_mapping"], batch["block_tables"], batch["seq_lens"], batch.get("cu_seqlens_q")
        )
        checks: list[tuple[object, tuple[object, ...]]] = [
            (ops.paged_sdpa.default, (q, kv, kv, *caches, meta.tensors(), scale)),
            (ops.write_kv.default, (kv, kv, *caches, batch["slot_mapping"], "torch")),
            (ops.paged_attention.default, (q, *caches, meta.tensors(), scale, "torch")),
        ]
        for op, args in checks:
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    assert ATTENTION_OP_NAME == "devgraph_ref::paged_sdpa"
    assert is_break_target(ops.paged_sdpa.default)
    assert not any(is_break_target(op) for op in (ops.write_kv.default, ops.paged_attention.default))


def _compiled_nodes(model: ReferenceModel) -> Mapping[str, int]:
    torch._dynamo.reset()
    try:
        batch = make_decode_batch(model, 5)
        expected = model.decode_step(**batch)
        backend = _RecordGraphs()
        compiled = torch.compile(model.decode_step, backend=backend, dynamic=True, fullgraph=True)
        # Rewriting the same K/V at the same slots is idempotent, so the model can be reused.
        torch.testing.assert_close(compiled(**batch), expected, rtol=1e-6, atol=1e-6)
        # A second batch size runs without a recompile (dynamic shapes).
        other = make_decode_batch(model, 3, seed=1)
        torch.testing.assert_close(compiled(**other), model.decode_step(**other), rtol=1e-6, atol=1e-6)
        assert len(backend.graphs) == 1
        counts: dict[str, int] = {}
        for node in backend.graphs[0].graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("devgraph_ref."):
                counts[str(node.target)] = counts.get(str(node.target), 0) + 1
        counts["break ops"] = sum(
            n.op == "call_function" and is_break_target(n.target) for n in backend.graphs[0].graph.nodes
        )
        return counts
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_torch_compile_keeps_attention_as_one_opaque_node_per_layer(attention: str) -> None:
    model = _model(attention)
    layers = model.config.num_layers
    if attention == "sdpa":
        expected = {"devgraph_ref.paged_sdpa.default": layers, "break ops": layers}
    else:
        expected = {
            "devgraph_ref.write_kv.default": layers,
            "devgraph_ref.paged_attention.default": layers,
            "break ops": 0,
        }
    assert _compiled_nodes(model) == expected
