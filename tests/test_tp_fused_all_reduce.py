"""The fused all-reduce + add (+ RMSNorm) of the tensor-parallel layers (``FusedAllReduce``).

On the CPU: the kernel builds to a cubin for a Hopper GPU (Triton's own ptxas assembles its inline PTX:
the flags' acquire loads and release stores, the timer and the trap), which calls take it, and that the
layers route both of their all-reduces through it. Its results on two GPUs (against NCCL's sum and the
add-and-norm kernel, in alternating CUDA graphs and in the model) are the ``multi_gpu`` test
``tests/test_tp.py::test_fused_all_reduce_equals_nccl_and_the_add_norm_in_graphs_and_the_model``.
"""

from __future__ import annotations

import pytest
import torch

from devgraph.reference import ReferenceConfig, make_decode_batch
from devgraph.reference.tp import TPReferenceModel
from devgraph.reference.tp.comm import (
    FUSED_MAX_COLS,
    FUSED_MAX_ROWS,
    FUSED_PROGRAMS,
    FusedAllReduce,
    TPComm,
    _peer_addresses,
)

pytestmark = pytest.mark.timeout(300)


def _cubin(world: int, rank: int, norm: bool) -> dict[str, str | bytes]:
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - a Triton without the ahead-of-time API
        pytest.skip(f"this Triton has no ahead-of-time compile API ({exc})")
    from devgraph.reference.tp import triton_all_reduce

    pointers = ("partial_ptr", "residual_ptr", "weight_ptr", "normed_ptr", "total_ptr", "local_ptr")
    signature = {name: "*bf16" for name in pointers}
    signature |= {"buffer_bases": "*i64", "flag_bases": "*i64"}
    ints = ("rows", "n_cols", "slab", "stride_p", "stride_r", "stride_n", "stride_t")
    signature |= {name: "i32" for name in ints}
    signature |= {"eps": "fp32"}
    constants = {
        "RANK": rank,
        "WORLD": world,
        "PROGRAMS": 32,
        "HAS_NORM": norm,
        "BLOCK": 4096,
    }
    signature |= {name: "constexpr" for name in constants}
    source = ASTSource(fn=triton_all_reduce._all_reduce_add_kernel, signature=signature, constexprs=constants)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (RuntimeError, FileNotFoundError) as exc:
        if "ptxas" in str(exc).lower():  # a Triton wheel without its CUDA assembler
            pytest.skip(f"Triton's ptxas is not usable here: {exc}")
        raise
    return compiled.asm


@pytest.mark.parametrize(("world", "rank", "norm"), [(2, 0, True), (2, 1, False), (4, 3, True)])
def test_the_kernel_assembles_for_a_hopper_gpu_with_its_flags(world, rank, norm):
    from devgraph.reference.tp import triton_all_reduce

    asm = _cubin(world, rank, norm)
    ptx = str(asm["ptx"])
    assert len(asm["cubin"]) > 0
    # Per peer: two waits (done, ready), each one thread spinning on an acquire load with a time limit
    # that traps and clearing the flag it saw, and two release stores (ready, done); the program's
    # threads meet between them.
    peers = world - 1
    assert ptx.count("ld.acquire.sys.global.u32") == 2 * peers
    assert ptx.count("st.relaxed.sys.global.u32") == 2 * peers
    assert ptx.count("st.release.sys.global.u32") == 2 * peers
    assert ptx.count("mov.u32 %thread, %tid.x") == 4 * peers  # each by thread 0 alone
    assert ptx.count("%globaltimer") >= 2 * peers and "trap;" in ptx
    assert f"%now, {triton_all_reduce.WAIT_LIMIT_NS};" in ptx  # the limit the module documents
    assert ptx.count("bar.sync") >= 3


def _fused_for(data: torch.Tensor, max_rows: int = FUSED_MAX_ROWS) -> FusedAllReduce:
    # fits() reads only the buffer and the row limit; the rest needs GPUs and a group.
    fused = FusedAllReduce.__new__(FusedAllReduce)
    fused.data, fused.max_rows, fused.programs = data, max_rows, FUSED_PROGRAMS
    return fused


def test_fits_takes_decode_sized_steps_of_the_buffers_dtype_only():
    fused = _fused_for(torch.empty(FUSED_MAX_ROWS * 4096, dtype=torch.bfloat16))
    x = torch.zeros(8, 4096, dtype=torch.bfloat16)
    assert fused.fits(x, x.clone())
    assert fused.fits(
        torch.zeros(FUSED_MAX_ROWS, 4096, dtype=torch.bfloat16),
        torch.zeros(FUSED_MAX_ROWS, 4096, dtype=torch.bfloat16),
    )
    too_many = torch.zeros(FUSED_MAX_ROWS + 1, 4096, dtype=torch.bfloat16)
    assert not fused.fits(too_many, too_many)  # a long prefill: the unfused path's wide kernels
    assert not fused.fits(x[:0], x[:0])  # nothing to reduce
    assert not fused.fits(x.float(), x.float())  # another dtype than the buffer's
    assert not fused.fits(x, x[:4])  # shapes differ
    strided = torch.zeros(4096, 8, dtype=torch.bfloat16).t()  # [8, 4096], a row's elements 8 apart
    assert fused.fits(strided.contiguous(), strided.contiguous()) and not fused.fits(strided, strided)
    wide = torch.zeros(1, FUSED_MAX_COLS * 2, dtype=torch.bfloat16)
    roomy = _fused_for(torch.empty(FUSED_PROGRAMS * FUSED_MAX_COLS * 2, dtype=torch.bfloat16))
    narrower = torch.zeros(1, FUSED_MAX_COLS, dtype=torch.bfloat16)
    assert roomy.fits(narrower, narrower) and not roomy.fits(wide, wide)  # past the widest row it keeps
    small = _fused_for(torch.empty(4 * 4096, dtype=torch.bfloat16))
    assert not small.fits(x, x)  # 8 rows do not fit a 4-row buffer


def test_one_rank_has_no_fused_all_reduce_and_says_so():
    comm = TPComm(None, "symm", torch.device("cpu"), dtype=torch.bfloat16, fuse=True)
    x = torch.ones(2, 16)
    assert comm.fused is None and comm.all_reduce_add(x, x, None, 1e-6) is None
    assert "one rank" in (comm.fallback_reason or "")


def test_both_all_reduces_of_every_layer_go_through_the_fused_call_when_it_takes_them(monkeypatch):
    config = ReferenceConfig.preset("tiny", kernels="torch", max_requests=4, max_seq_len=64)
    model = TPReferenceModel(config, seed=0)
    batch = make_decode_batch(model, 2, seq_lens=8, seed=0)
    with torch.no_grad():
        plain = model.decode_step(**batch)
    calls: list[bool] = []

    def fused_stand_in(partial, residual, weight, eps):  # what the kernel computes, on one rank
        calls.append(weight is not None)
        total = residual + partial
        if weight is None:
            return None, total
        xf = total.float()
        normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(total.dtype)
        return normed, total

    monkeypatch.setattr(model.comm, "all_reduce_add", fused_stand_in)
    with torch.no_grad():
        routed = model.decode_step(**batch)
    # Per layer: after attention with the post-attention norm's weight, after the MLP without one.
    assert calls == [True, False] * config.num_layers
    torch.testing.assert_close(routed, plain, rtol=0, atol=0)


def test_a_row_count_that_overflows_a_programs_slab_takes_the_unfused_path():
    # 33 rows: program 0 holds rows 0 and 32, two rows of its slab; a slab of one row refuses it.
    fused = _fused_for(torch.empty(FUSED_PROGRAMS * 1024, dtype=torch.bfloat16))
    x32 = torch.zeros(32, 1024, dtype=torch.bfloat16)
    x33 = torch.zeros(33, 1024, dtype=torch.bfloat16)
    assert fused.fits(x32, x32) and not fused.fits(x33, x33)


class _Handle:
    def __init__(self, bases: list[int], offset: int = 0) -> None:
        self.buffer_ptrs, self.offset = bases, offset


def test_peer_addresses_follow_the_handles_offset_or_are_refused():
    from devgraph import ConfigError

    tensor = torch.empty(8)
    here = tensor.data_ptr()
    assert _peer_addresses(_Handle([here, 1000]), tensor, 0) == [here, 1000]
    assert _peer_addresses(_Handle([5000, here - 64], offset=64), tensor, 1) == [5064, here]
    with pytest.raises(ConfigError, match="cannot locate"):
        _peer_addresses(_Handle([here + 4096, 1000]), tensor, 0)


# -- the flag protocol, modelled: every interleaving the GPUs may take ---------------------------------------
# A model of the kernel's protocol (triton_all_reduce.py, steps 1-5), run step by step under random
# schedules: each rank runs its calls in order (one stream), a call's programs run in any order against
# every other rank's, and each read of a peer's row checks it holds that call's value. It tests the design
# (flags per program and peer, the fixed row-to-program map, each program's slab); the PTX is the cubin
# test's and the GPUs' (tests/test_tp.py).
def _slab_layout(program: int, index: int, cols: int, slab: int) -> int:
    return program * slab + index * cols


def _row_layout(program: int, index: int, cols: int, slab: int, programs: int = 4) -> int:
    return (index * programs + program) * cols  # rows packed by row number: the layout before the slabs


def _run_protocol(calls, ranks, programs, numel, layout, seed):  # type: ignore[no-untyped-def]
    import random

    rng = random.Random(seed)
    slab = numel // programs
    memory = [[None] * numel for _ in range(ranks)]
    # flags[rank][kind][program][peer]; done flags start set, as FusedAllReduce.create leaves them
    flags = [
        {"ready": [[0] * ranks for _ in range(programs)], "done": [[1] * ranks for _ in range(programs)]}
        for _ in range(ranks)
    ]
    problems: list[str] = []

    def program_steps(rank, call, rows, cols, b):  # type: ignore[no-untyped-def]
        peers = [p for p in range(ranks) if p != rank]
        for p in peers:  # 1. every peer done with this program's rows of its last call
            while not flags[rank]["done"][b][p]:
                yield
            flags[rank]["done"][b][p] = 0
        mine = list(range(b, rows, programs))
        for i, row in enumerate(mine):  # 2. this rank's rows into its buffer
            for c in range(cols):
                memory[rank][layout(b, i, cols, slab) + c] = (call, rank, row, c)
                yield
        for p in peers:  # 3. ready to every peer, then every peer's ready
            flags[p]["ready"][b][rank] = 1
        yield
        for p in peers:
            while not flags[rank]["ready"][b][p]:
                yield
            flags[rank]["ready"][b][p] = 0
        for i, row in enumerate(mine):  # 4. read every peer's rows
            for p in peers:
                for c in range(cols):
                    got = memory[p][layout(b, i, cols, slab) + c]
                    if got != (call, p, row, c):
                        problems.append(f"call {call} rank {rank} program {b} row {row}: read {got}")
                    yield
        for p in peers:  # 5. done reading
            flags[p]["done"][b][rank] = 1
        yield

    def rank_calls(rank):  # type: ignore[no-untyped-def]
        for call, (rows, cols) in enumerate(calls):  # one call after another: the stream's order
            running = [program_steps(rank, call, rows, cols, b) for b in range(min(rows, programs))]
            while running:  # the call's programs in any order
                step = rng.choice(running)
                try:
                    next(step)
                except StopIteration:
                    running.remove(step)
                yield

    streams = [rank_calls(r) for r in range(ranks)]
    for _ in range(2_000_000):
        if not streams or problems:
            break
        stream = rng.choice(streams)
        try:
            next(stream)
        except StopIteration:
            streams.remove(stream)
    assert not streams or problems, "the protocol did not finish: a deadlock"
    return problems


_MIXED_CALLS = [(1, 2), (6, 3), (3, 2), (9, 1), (2, 3), (5, 2), (1, 3), (8, 2)] * 3


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_protocol_with_slabs_never_reads_a_row_another_call_wrote(ranks):
    for seed in range(40):
        assert (
            _run_protocol(_MIXED_CALLS, ranks, programs=4, numel=4 * 8, layout=_slab_layout, seed=seed) == []
        )


def test_the_protocol_without_slabs_is_caught_reading_a_row_of_another_width():
    # The layout before the adversarial reading: a call of another width overwrites a row a peer's other
    # program still reads. The model must find it, or it proves nothing above.
    found = [
        _run_protocol(_MIXED_CALLS, 2, programs=4, numel=4 * 8, layout=_row_layout, seed=seed)
        for seed in range(40)
    ]
    assert any(found), "no schedule caught the unslabbed layout"
