"""The attention kernels of the reference model (devgraph.reference.kernels).

CPU: the torch reference against a straightforward float64 attention written here (a loop over
requests and heads with an explicit softmax), over random batches with padding requests and tokens,
GQA, block tables in random block order, chunked prefill with a cached prefix, and a capture of each
reference function into the CPU simulated graph replayed for other batch compositions. Unused cache
slots, stale block-table entries and padding rows hold NaN or out-of-range values, so reading one
shows up as a NaN in a real row.

Triton: under ``TRITON_INTERPRET=1`` on the CPU (tiny shapes, in a child process so the interpreted
kernels never mix with compiled ones) when triton imports, and on a GPU (``cuda`` marker) against the
reference, plus a ``torch.cuda.CUDAGraph`` capture replayed over many batch compositions.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

from devgraph.errors import BackendUnavailableError, ConfigError, InputError
from devgraph.platforms.sim.graph import SimGraph, begin_capture, end_capture
from devgraph.reference.kernels import (
    AttentionKernels,
    PagedMetadata,
    attention_backend,
    available_backends,
    backends,
    torch_ref,
)

PAGE = 16
HAS_TRITON = importlib.util.find_spec("triton") is not None
# GPU tolerances, as the relative L2 error ||triton - ref|| / ||ref|| where ref is the torch reference in
# float32 on the same half-precision inputs: bf16 keeps 8 mantissa bits (the probabilities are rounded to
# bf16 before the P @ V product, as every flash kernel does), fp16 keeps 11.
GPU_REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


# -- batches -----------------------------------------------------------------------------------------
@dataclass
class Paged:
    """A paged cache and the metadata of one batch composition, plus host copies for the naive check."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    lengths: list[int]

    def meta(self, cu_seqlens_q: torch.Tensor | None = None) -> PagedMetadata:
        return meta_of(self.block_tables, self.seq_lens, cu_seqlens_q)


def meta_of(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None
) -> PagedMetadata:
    """The attention functions' metadata; the slot mapping (only ``write_kv`` reads one) is empty."""
    return PagedMetadata(torch.empty(0, dtype=torch.long), block_tables, seq_lens, cu_seqlens_q)


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan"))


def paged_batch(
    gen: torch.Generator,
    lengths: list[int],
    *,
    max_blocks: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Paged:
    """Requests of ``lengths`` over blocks in random order; cache slots past each length, the spare block
    and stale table entries are poison (NaN block, -1, out of range). ``num_blocks`` depends only on
    ``len(lengths)`` and ``max_blocks``, so one cache shape serves every composition."""
    requests = len(lengths)
    num_blocks = requests * max_blocks + 1
    poison = num_blocks - 1
    shape = (num_blocks, PAGE, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    stale = [poison, -1, num_blocks + 3]
    table = [[stale[(r + i) % 3] for i in range(max_blocks)] for r in range(requests)]
    for r, length in enumerate(lengths):
        assert length <= max_blocks * PAGE
        for i in range(math.ceil(length / PAGE)):
            table[r][i] = order.pop()
        if length % PAGE:  # the rest of the last block was never written
            for cache in (k_cache, v_cache):
                _poison(cache[table[r][length // PAGE], length % PAGE :])
    for cache in (k_cache, v_cache):
        _poison(cache[poison])
    return Paged(
        k_cache.to(device=device, dtype=dtype),
        v_cache.to(device=device, dtype=dtype),
        torch.tensor(table, dtype=torch.int32, device=device).reshape(requests, max_blocks),
        torch.tensor(lengths, dtype=torch.int32, device=device),
        list(lengths),
    )


def cu_of(lengths: list[int], *, device: str | torch.device = "cpu") -> torch.Tensor:
    """``cu_seqlens`` (int32) of segments of ``lengths``."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def packed(gen: torch.Generator, tokens: int, real: int, heads: int, dim: int) -> torch.Tensor:
    """``[tokens, heads, dim]`` random rows; rows at or past ``real`` (padding) are NaN."""
    x = torch.randn(tokens, heads, dim, generator=gen)
    _poison(x[real:])
    return x


# -- the straightforward float64 attention -----------------------------------------------------------
def request_kv(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, KVH, D]`` float64: request positions 0..length-1 read one by one through its table."""
    rows = [cache[int(table_row[p // PAGE]), p % PAGE] for p in range(length)]
    return torch.stack(rows).double() if rows else cache.new_zeros((0, *cache.shape[2:])).double()


def naive(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int] | None, scale: float
) -> torch.Tensor:
    """``q [n, H, D]`` against ``keys``/``values [L, KVH, D]``; query ``i`` sees keys ``<= positions[i]``
    (all of them when ``positions`` is None); a query that sees nothing gives zeros."""
    q, keys, values = q.double(), keys.double(), values.double()
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(n, heads, dim, dtype=torch.float64)
    for i in range(n):
        seen = keys.shape[0] if positions is None else max(min(positions[i] + 1, keys.shape[0]), 0)
        if seen == 0:
            continue
        for h in range(heads):
            scores = keys[:seen, h // group] @ q[i, h] * scale  # [seen]
            weights = torch.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ values[:seen, h // group]
    return out


def naive_decode(q: torch.Tensor, batch: Paged, scale: float) -> torch.Tensor:
    q, k_cache, v_cache, tables = q.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu(), batch.block_tables.cpu()
    rows = []
    for r, length in enumerate(batch.lengths):
        keys, values = request_kv(k_cache, tables[r], length), request_kv(v_cache, tables[r], length)
        rows.append(naive(q[r : r + 1], keys, values, None, scale))
    return torch.cat(rows)


def naive_prefill(q: torch.Tensor, batch: Paged, query_lens: list[int], scale: float) -> torch.Tensor:
    q, k_cache, v_cache, tables = q.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu(), batch.block_tables.cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for r, (length, q_len) in enumerate(zip(batch.lengths, query_lens, strict=True)):
        keys, values = request_kv(k_cache, tables[r], length), request_kv(v_cache, tables[r], length)
        positions = [length - q_len + i for i in range(q_len)]
        out[start : start + q_len] = naive(q[start : start + q_len], keys, values, positions, scale)
        start += q_len
    return out


def naive_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: list[int], scale: float, causal: bool
) -> torch.Tensor:
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for length in seg_lens:
        stop = start + length
        positions = list(range(length)) if causal else None
        out[start:stop] = naive(q[start:stop], k[start:stop], v[start:stop], positions, scale)
        start = stop
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 2e-5) -> None:
    """float32 reference vs float64: equal to rounding; padding rows exactly zero (no NaN anywhere)."""
    assert not torch.isnan(actual).any(), "a NaN reached the output: a masked row or slot was read"
    torch.testing.assert_close(actual.double().cpu(), expected, atol=atol, rtol=1e-4)


# -- a random composition ----------------------------------------------------------------------------
def decode_case(seed: int, heads: int, kv_heads: int, dim: int, requests: int = 6, max_blocks: int = 5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_blocks * PAGE + 1, (requests,), generator=gen).tolist()
    lengths[int(torch.randint(0, requests, (1,), generator=gen))] = 0  # a padding request
    lengths[-1] = 0
    batch = paged_batch(gen, lengths, max_blocks=max_blocks, kv_heads=kv_heads, dim=dim)
    q = torch.randn(requests, heads, dim, generator=gen)
    for r, length in enumerate(lengths):
        if length == 0:
            _poison(q[r])
    return batch, q


def prefill_case(seed: int, heads: int, kv_heads: int, dim: int, tokens: int = 48, max_blocks: int = 6):
    """A chunked-prefill / verify mix: each request has a cached prefix and 1..16 new tokens; the last
    requests are padding (no queries, repeated offsets) and the tail tokens are padding."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [int(x) for x in torch.randint(1, 17, (4,), generator=gen)] + [0, 0]
    while sum(query_lens) > tokens - 3:
        query_lens[int(torch.argmax(torch.tensor(query_lens)))] -= 1
    lengths = []
    for q_len in query_lens:
        prefix = int(torch.randint(0, max_blocks * PAGE - q_len + 1, (1,), generator=gen))
        lengths.append(0 if q_len == 0 else prefix + q_len)
    batch = paged_batch(gen, lengths, max_blocks=max_blocks, kv_heads=kv_heads, dim=dim)
    q = packed(gen, tokens, sum(query_lens), heads, dim)
    return batch, q, query_lens


# -- CPU: the reference against the naive attention --------------------------------------------------
HEAD_SHAPES = [(4, 4, 16), (8, 2, 64), (6, 3, 16)]  # (heads, kv heads, head dim): MHA and GQA


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), HEAD_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_decode_matches_naive(heads: int, kv_heads: int, dim: int, seed: int) -> None:
    batch, q = decode_case(seed, heads, kv_heads, dim)
    scale = dim**-0.5
    out = torch_ref.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.meta(), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, naive_decode(q, batch, scale))
    assert torch.count_nonzero(out[-1]) == 0  # the padding request


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), HEAD_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_prefill_matches_naive(heads: int, kv_heads: int, dim: int, seed: int) -> None:
    batch, q, query_lens = prefill_case(seed, heads, kv_heads, dim)
    cu = cu_of(query_lens)
    scale = dim**-0.5
    out = torch_ref.paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.meta(cu), scale)
    assert_matches(out, naive_prefill(q, batch, query_lens, scale))
    assert torch.count_nonzero(out[sum(query_lens) :]) == 0  # padding tokens


def test_reference_prefill_without_prefix_is_plain_causal_attention() -> None:
    """New requests only (no cached prefix): the packed-prefill special case engines use most."""
    gen = torch.Generator().manual_seed(3)
    query_lens = [5, 17, 1]
    batch = paged_batch(gen, query_lens, max_blocks=2, kv_heads=2, dim=16)
    q = packed(gen, 24, 23, 4, 16)
    out = torch_ref.paged_prefill_attention(
        q, batch.k_cache, batch.v_cache, batch.meta(cu_of(query_lens)), 0.3
    )
    assert_matches(out, naive_prefill(q, batch, query_lens, 0.3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), HEAD_SHAPES)
def test_reference_varlen_matches_naive(causal: bool, heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim + heads)
    seg_lens = [7, 0, 19, 1, 12, 0]  # an empty segment between real ones, and padding segments at the end
    tokens = sum(seg_lens) + 5
    q = packed(gen, tokens, sum(seg_lens), heads, dim)
    k = packed(gen, tokens, sum(seg_lens), kv_heads, dim)
    v = packed(gen, tokens, sum(seg_lens), kv_heads, dim)
    out = torch_ref.varlen_attention(q, k, v, cu_of(seg_lens), dim**-0.5, causal=causal)
    assert_matches(out, naive_varlen(q, k, v, seg_lens, dim**-0.5, causal))
    assert torch.count_nonzero(out[sum(seg_lens) :]) == 0


def test_reference_varlen_chunks_long_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``_VARLEN_QUERY_CHUNK`` tokens the queries are scored in chunks: same result."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(40, 2, 16, generator=gen) for _ in range(3))
    cu = cu_of([13, 20, 3])
    whole = torch_ref.varlen_attention(q, k, v, cu, 0.25, causal=True)
    monkeypatch.setattr(torch_ref, "_VARLEN_QUERY_CHUNK", 16)
    torch.testing.assert_close(torch_ref.varlen_attention(q, k, v, cu, 0.25, causal=True), whole)


def _expected_write(k_cache: torch.Tensor, k: torch.Tensor, slots: list[int]) -> torch.Tensor:
    expected = k_cache.clone()
    for i, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // PAGE, slot % PAGE] = k[i]
    return expected


@pytest.mark.parametrize("slots", [[5, -1, 40, 17, -1, 63], [-1, -1, -1], [33]])
def test_reference_write_kv(slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(slots))
    k_cache, v_cache = (torch.randn(4, PAGE, 2, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(len(slots), 2, 16, generator=gen) for _ in range(2))
    expected_k, expected_v = _expected_write(k_cache, k, slots), _expected_write(v_cache, v, slots)
    torch_ref.write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_reference_write_kv_casts_to_the_cache_dtype() -> None:
    k_cache, v_cache = (torch.zeros(2, PAGE, 1, 16, dtype=torch.bfloat16) for _ in range(2))
    k = torch.randn(2, 1, 16)
    torch_ref.write_kv(k, -k, k_cache, v_cache, torch.tensor([3, 20], dtype=torch.int32))
    assert torch.equal(k_cache[1, 4], k[1].to(torch.bfloat16)) and torch.equal(
        v_cache[0, 3], -k[0].to(torch.bfloat16)
    )


# -- CPU: the reference captured into the simulated graph --------------------------------------------
def _capture(fn, *args):
    """Capture ``fn(*args)`` into a SimGraph; returns the graph and the captured output."""
    graph = SimGraph()
    begin_capture(graph)
    out = fn(*args)
    end_capture(graph)
    return graph, out


def test_reference_decode_and_prefill_replay_any_composition() -> None:
    """One capture per padded shape; new lengths, block tables and query splits written in place."""
    heads, kv_heads, dim, scale = 4, 2, 16, 0.25
    batch, q = decode_case(10, heads, kv_heads, dim)
    statics = (
        q.clone(),
        batch.k_cache.clone(),
        batch.v_cache.clone(),
        batch.block_tables.clone(),
        batch.seq_lens.clone(),
    )
    meta = meta_of(*statics[3:])
    graph, out = _capture(torch_ref.paged_decode_attention, *statics[:3], meta, scale)
    for seed in (11, 12, 13):
        other, q_new = decode_case(seed, heads, kv_heads, dim)
        for static, new in zip(
            statics, (q_new, other.k_cache, other.v_cache, other.block_tables, other.seq_lens), strict=True
        ):
            static.copy_(new)
        graph.replay()
        direct = torch_ref.paged_decode_attention(*statics[:3], meta, scale)
        assert torch.equal(out, direct)
        assert_matches(out, naive_decode(q_new, other, scale))

    batch, q, query_lens = prefill_case(20, heads, kv_heads, dim)
    cu = cu_of(query_lens)
    statics = (
        q.clone(),
        batch.k_cache.clone(),
        batch.v_cache.clone(),
        batch.block_tables.clone(),
        batch.seq_lens.clone(),
        cu,
    )
    meta = meta_of(*statics[3:])
    graph, out = _capture(torch_ref.paged_prefill_attention, *statics[:3], meta, scale)
    for seed in (21, 22):
        other, q_new, lens_new = prefill_case(seed, heads, kv_heads, dim)
        news = (q_new, other.k_cache, other.v_cache, other.block_tables, other.seq_lens, cu_of(lens_new))
        for static, new in zip(statics, news, strict=True):
            static.copy_(new)
        graph.replay()
        assert torch.equal(out, torch_ref.paged_prefill_attention(*statics[:3], meta, scale))
        assert_matches(out, naive_prefill(q_new, other, lens_new, scale))


def test_reference_varlen_and_write_replay_any_composition() -> None:
    gen = torch.Generator().manual_seed(30)
    tokens, heads, dim = 32, 2, 16
    q, k, v = (torch.randn(tokens, heads, dim, generator=gen) for _ in range(3))
    cu = cu_of([32, 0, 0])
    graph, out = _capture(torch_ref.varlen_attention, q, k, v, cu, 0.25, True)
    for split in ([10, 22, 0], [1, 2, 25], [0, 0, 30]):  # the same T, cut into other images
        cu.copy_(cu_of(split))
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen))
        graph.replay()
        assert torch.equal(out, torch_ref.varlen_attention(q, k, v, cu, 0.25, True))
        assert_matches(out, naive_varlen(q, k, v, split, 0.25, True))
        assert torch.count_nonzero(out[sum(split) :]) == 0

    base_k, base_v = (torch.randn(3, PAGE, 2, 16, generator=gen) for _ in range(2))
    k_cache, v_cache = base_k.clone(), base_v.clone()
    kv = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    slots = torch.tensor([0, 1, 2, 3])
    graph, _ = _capture(torch_ref.write_kv, *kv, k_cache, v_cache, slots)
    for new_slots in ([47, -1, 16, 5], [-1, -1, -1, -1], [9, 8, -1, 30]):
        slots.copy_(torch.tensor(new_slots))
        k_cache.copy_(base_k)
        v_cache.copy_(base_v)
        graph.replay()
        assert torch.equal(k_cache, _expected_write(base_k, kv[0], new_slots))
        assert torch.equal(v_cache, _expected_write(base_v, kv[1], new_slots))


# -- CPU: the dispatcher and the input checks --------------------------------------------------------
def test_backends_torch_and_auto_on_cpu() -> None:
    assert "torch" in available_backends()
    torch_kernels = attention_backend("torch")
    assert isinstance(torch_kernels, AttentionKernels) and torch_kernels.name == "torch"
    assert torch_kernels.paged_decode_attention is torch_ref.paged_decode_attention
    batch, q = decode_case(40, 4, 2, 16)
    args = (q, batch.k_cache, batch.v_cache, batch.meta(), 0.25)
    # auto on CPU tensors is the reference, whether or not triton imports
    assert torch.equal(
        attention_backend("auto").paged_decode_attention(*args), torch_ref.paged_decode_attention(*args)
    )


def test_backend_triton_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "devgraph.reference.kernels.triton_ops", raising=False)
    monkeypatch.delitem(sys.modules, "devgraph.reference.kernels.triton_kernels", raising=False)
    backends._load_triton.cache_clear()
    try:
        assert available_backends() == ("torch",)
        with pytest.raises(BackendUnavailableError, match=r"pip install 'devgraph\[triton\]'"):
            attention_backend("triton")
        assert attention_backend("auto").name == "auto"  # still usable: falls back to the reference
        # The demo prints and the server logs why a GPU runs the reference kernels; never on the CPU.
        note = backends.auto_fallback_note("auto", torch.device("cuda"))
        assert note is not None and "triton, which is not installed: pip install 'devgraph[triton]'" in note
        assert "torch reference attention" in note
        assert backends.auto_fallback_note("auto", torch.device("cpu")) is None
        assert backends.auto_fallback_note("torch", torch.device("cuda")) is None
    finally:
        backends._load_triton.cache_clear()


def test_backend_unknown_name() -> None:
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'.*auto, triton, torch"):
        attention_backend("flash")


def test_input_checks_name_the_problem() -> None:
    batch, q = decode_case(50, 4, 2, 16)
    with pytest.raises(InputError, match="multiple of the number of kv heads"):
        torch_ref.paged_decode_attention(q[:, :3], batch.k_cache, batch.v_cache, batch.meta(), 1.0)
    with pytest.raises(InputError, match="seq_lens has dtype torch.float32"):
        torch_ref.paged_decode_attention(
            q, batch.k_cache, batch.v_cache, meta_of(batch.block_tables, batch.seq_lens.float()), 1.0
        )
    with pytest.raises(InputError, match="block_size is 8"):
        torch_ref.write_kv(
            q[:, :2],
            q[:, :2],
            torch.zeros(2, 8, 2, 16),
            torch.zeros(2, 8, 2, 16),
            torch.zeros(6, dtype=torch.long),
        )
    with pytest.raises(InputError, match="R \\+ 1 cumulative query offsets"):
        torch_ref.paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.meta(batch.seq_lens), 1.0)
    with pytest.raises(InputError, match="cu_seqlens_q is None.*paged_decode_attention"):
        torch_ref.paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.meta(), 1.0)


# -- Triton under the interpreter (CPU) --------------------------------------------------------------
_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from devgraph.reference.kernels import torch_ref, triton_ops
    from test_kernels import cu_of, decode_case, prefill_case, packed

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))

    half = torch.float16
    for heads, kv_heads, dim in ((4, 2, 16), (2, 2, 32)):
        batch, q = decode_case(1, heads, kv_heads, dim, requests=3, max_blocks=3)
        caches = batch.k_cache.to(half), batch.v_cache.to(half)
        args = (q.to(half), *caches, batch.meta(), 0.3)
        ref = torch_ref.paged_decode_attention(*args)
        for splits in (1, 3):
            config = triton_ops.DecodeConfig(splits=splits, block_n=16)
            out = triton_ops.paged_decode_attention(*args, config=config)
            assert not out.isnan().any() and rel(out, ref) < 3e-3, ("decode", splits, rel(out, ref))
        batch, q, query_lens = prefill_case(2, heads, kv_heads, dim, tokens=24, max_blocks=3)
        caches = batch.k_cache.to(half), batch.v_cache.to(half)
        args = (q.to(half), *caches, batch.meta(cu_of(query_lens)), 0.3)
        config = triton_ops.PrefillConfig(block_m=16, block_n=16)
        out = triton_ops.paged_prefill_attention(*args, config=config)
        ref = torch_ref.paged_prefill_attention(*args)
        assert not out.isnan().any() and rel(out, ref) < 3e-3, ("prefill", rel(out, ref))
        gen = torch.Generator().manual_seed(3)
        seg = [9, 0, 20]
        q, k, v = (packed(gen, 33, 29, h, dim).to(half) for h in (heads, kv_heads, kv_heads))
        for causal in (False, True):
            out = triton_ops.varlen_attention(q, k, v, cu_of(seg), 0.3, causal, config=config)
            ref = torch_ref.varlen_attention(q, k, v, cu_of(seg), 0.3, causal)
            assert not out.isnan().any() and rel(out, ref) < 3e-3, ("varlen", causal, rel(out, ref))
        caches = [torch.zeros(3, 16, kv_heads, dim, dtype=half) for _ in range(4)]
        kv = torch.randn(5, kv_heads, dim).to(half)
        slots = torch.tensor([3, -1, 40, 17, -1])
        triton_ops.write_kv(kv, kv, caches[0], caches[1], slots)
        torch_ref.write_kv(kv, kv, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), "write_kv"
    print("interpreter ok")
    """
)


@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (CPU CI has no triton; see the module docstring)"
)
def test_triton_kernels_under_the_interpreter() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout


# -- GPU: Triton against the reference, and CUDA-graph replay ----------------------------------------
def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-6))


def _gpu_decode_case(seed: int, requests: int, max_blocks: int, heads: int, kv_heads: int, dim: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_blocks * PAGE + 1, (requests,), generator=gen).tolist()
    for r in range(0, requests, 5):
        lengths[r] = 0
    batch = paged_batch(
        gen, lengths, max_blocks=max_blocks, kv_heads=kv_heads, dim=dim, dtype=dtype, device="cuda"
    )
    q = torch.randn(requests, heads, dim, generator=gen).to(device="cuda", dtype=dtype)
    return batch, q


def _gpu_prefill_case(
    seed: int, tokens: int, requests: int, max_blocks: int, heads: int, kv_heads: int, dim: int, dtype
):
    gen = torch.Generator().manual_seed(seed)
    real = int(torch.randint(tokens // 2, tokens + 1, (1,), generator=gen))
    cuts = sorted(torch.randint(0, real + 1, (requests - 2,), generator=gen).tolist())
    query_lens = [b - a for a, b in zip([0, *cuts], [*cuts, real], strict=True)] + [
        0
    ]  # the last request is padding
    lengths = []
    for q_len in query_lens:
        prefix = int(torch.randint(0, max(max_blocks * PAGE - q_len, 0) + 1, (1,), generator=gen))
        lengths.append(min(prefix + q_len, max_blocks * PAGE) if q_len else 0)
    query_lens = [min(q, length) for q, length in zip(query_lens, lengths, strict=True)]
    batch = paged_batch(
        gen, lengths, max_blocks=max_blocks, kv_heads=kv_heads, dim=dim, dtype=dtype, device="cuda"
    )
    q = packed(gen, tokens, sum(query_lens), heads, dim).to(device="cuda", dtype=dtype)
    return batch, q, cu_of(query_lens, device="cuda")


GPU_SHAPES = [(16, 8, 128), (8, 2, 64), (4, 4, 64), (16, 2, 128)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), GPU_SHAPES)
def test_triton_decode_matches_reference(dtype, heads: int, kv_heads: int, dim: int) -> None:
    kernels = attention_backend("triton")
    for seed, (requests, max_blocks) in enumerate([(1, 64), (3, 40), (8, 9), (33, 20), (64, 4), (2, 200)]):
        batch, q = _gpu_decode_case(seed, requests, max_blocks, heads, kv_heads, dim, dtype)
        args = (q, batch.k_cache, batch.v_cache, batch.meta(), dim**-0.5)
        out = kernels.paged_decode_attention(*args)
        ref = torch_ref.paged_decode_attention(*args)
        assert not out.isnan().any(), (requests, max_blocks)
        assert rel_l2(out, ref) <= GPU_REL_L2[dtype], (requests, max_blocks, rel_l2(out, ref))
        zero_rows = batch.seq_lens == 0
        assert torch.count_nonzero(out[zero_rows]) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), GPU_SHAPES)
def test_triton_prefill_matches_reference(dtype, heads: int, kv_heads: int, dim: int) -> None:
    kernels = attention_backend("triton")
    cases = [(512, 3, 33), (64, 9, 8), (256, 5, 40), (40, 11, 4), (300, 2, 24)]  # tokens, R + 1, max blocks
    for seed, (tokens, requests, max_blocks) in enumerate(cases):
        batch, q, cu = _gpu_prefill_case(seed, tokens, requests, max_blocks, heads, kv_heads, dim, dtype)
        args = (q, batch.k_cache, batch.v_cache, batch.meta(cu), dim**-0.5)
        out = kernels.paged_prefill_attention(*args)
        ref = torch_ref.paged_prefill_attention(*args)
        assert not out.isnan().any(), (tokens, requests)
        assert rel_l2(out, ref) <= GPU_REL_L2[dtype], (tokens, requests, rel_l2(out, ref))
        assert torch.count_nonzero(out[int(cu[-1]) :]) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), GPU_SHAPES)
def test_triton_varlen_and_write_match_reference(dtype, heads: int, kv_heads: int, dim: int) -> None:
    kernels = attention_backend("triton")
    gen = torch.Generator().manual_seed(heads + dim)
    for seg_lens, tokens in (([1024], 1024), ([100, 0, 412, 256, 7], 800), ([3, 64, 1], 70)):
        real = sum(seg_lens)
        q, k, v = (packed(gen, tokens, real, h, dim).to("cuda", dtype) for h in (heads, kv_heads, kv_heads))
        cu = cu_of(seg_lens, device="cuda")
        for causal in (False, True):
            out = kernels.varlen_attention(q, k, v, cu, dim**-0.5, causal)
            ref = torch_ref.varlen_attention(q, k, v, cu, dim**-0.5, causal)
            assert not out.isnan().any() and rel_l2(out, ref) <= GPU_REL_L2[dtype], (seg_lens, causal)
            assert torch.count_nonzero(out[real:]) == 0
    caches = [torch.randn(20, PAGE, kv_heads, dim, generator=gen).to("cuda", dtype) for _ in range(2)]
    copies = [c.clone() for c in caches]
    kv = [torch.randn(50, kv_heads, dim, generator=gen).to("cuda", dtype) for _ in range(2)]
    slots = torch.randperm(20 * PAGE, generator=gen)[:50].cuda()
    slots[::7] = -1
    kernels.write_kv(*kv, *caches, slots)
    torch_ref.write_kv(*kv, *copies, slots)
    assert torch.equal(caches[0], copies[0]) and torch.equal(caches[1], copies[1])


@pytest.mark.cuda
def test_triton_cuda_graph_replays_any_composition() -> None:
    """Capture each Triton function once for one padded shape; replay with other compositions written
    into the same metadata tensors; compare with the reference on the same tensors."""
    kernels = attention_backend("triton")
    dtype, heads, kv_heads, dim = torch.bfloat16, 16, 8, 128
    requests, max_blocks, tokens = 8, 40, 256

    def capture(fn, *args):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*args)  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*args)
        return graph, out

    def load(statics, news):
        for static, new in zip(statics, news, strict=True):
            static.copy_(new)

    batch, q = _gpu_decode_case(0, requests, max_blocks, heads, kv_heads, dim, dtype)
    statics = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    meta = meta_of(*statics[3:])
    graph, out = capture(kernels.paged_decode_attention, *statics[:3], meta, dim**-0.5)
    for seed in range(1, 6):
        other, q_new = _gpu_decode_case(seed, requests, max_blocks, heads, kv_heads, dim, dtype)
        load(statics, (q_new, other.k_cache, other.v_cache, other.block_tables, other.seq_lens))
        graph.replay()
        ref = torch_ref.paged_decode_attention(*statics[:3], meta, dim**-0.5)
        assert rel_l2(out, ref) <= GPU_REL_L2[dtype], ("decode", seed)

    batch, q, cu = _gpu_prefill_case(0, tokens, requests, max_blocks, heads, kv_heads, dim, dtype)
    statics = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, cu)
    meta = meta_of(*statics[3:])
    graph, out = capture(kernels.paged_prefill_attention, *statics[:3], meta, dim**-0.5)
    for seed in range(1, 6):
        other, q_new, cu_new = _gpu_prefill_case(
            seed, tokens, requests, max_blocks, heads, kv_heads, dim, dtype
        )
        load(statics, (q_new, other.k_cache, other.v_cache, other.block_tables, other.seq_lens, cu_new))
        graph.replay()
        ref = torch_ref.paged_prefill_attention(*statics[:3], meta, dim**-0.5)
        assert rel_l2(out, ref) <= GPU_REL_L2[dtype], ("prefill", seed)
        assert torch.count_nonzero(out[int(cu_new[-1]) :]) == 0

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen).to("cuda", dtype) for h in (heads, heads, heads))
    cu = cu_of([tokens, 0, 0, 0], device="cuda")
    graph, out = capture(kernels.varlen_attention, q, k, v, cu, dim**-0.5, False)
    for split in ([64, 64, 64, 64], [1, 200, 0, 50], [0, 0, 0, 100]):  # the same T, other images
        cu.copy_(cu_of(split, device="cuda"))
        graph.replay()
        ref = torch_ref.varlen_attention(q, k, v, cu, dim**-0.5, False)
        assert rel_l2(out, ref) <= GPU_REL_L2[dtype], ("varlen", split)

    base = [torch.randn(10, PAGE, kv_heads, dim, generator=gen).to("cuda", dtype) for _ in range(2)]
    caches = [b.clone() for b in base]
    kv = [torch.randn(6, kv_heads, dim, generator=gen).to("cuda", dtype) for _ in range(2)]
    slots = torch.arange(6, device="cuda")
    graph, _ = capture(kernels.write_kv, *kv, *caches, slots)
    for new_slots in ([150, -1, 3, 77, 16, -1], [-1] * 6):
        slots.copy_(torch.tensor(new_slots))
        for cache, b in zip(caches, base, strict=True):
            cache.copy_(b)
        graph.replay()
        expected = [b.clone() for b in base]
        torch_ref.write_kv(*kv, *expected, slots)
        assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
