"""One Triton kernel for a tensor-parallel layer's all-reduce and what follows it: the partial sums of every
rank read over NVLink from symmetric memory, added in rank order, the residual added, and (optionally)
the sum RMS-normed, in one launch where the unfused path takes two (an all-reduce kernel, then the
add-and-norm kernel) and waits on a barrier between them (imports triton; GPUs only).

Rounding: the ranks' partials summed in float32 in rank order and rounded once to the model's dtype, that
plus the residual rounded again (``torch.add``), then the norm exactly as
:func:`devgraph.reference.kernels.triton_fused.rms_norm` does. With two ranks that is the unfused path bit
for bit (one addition, one rounding); with more, NCCL and torch's one-shot kernel round after each
addition, so the two paths may differ in the last bit. Every rank sums in the same order, so every rank
gets the same bits.

One call in flight per buffer: the calls of a group must be ordered on one stream (as every collective of
a group must be); two streams issuing fused calls at once on one rank would take each other's flags.

Row ``r`` always belongs to program ``r % programs``, whatever the grid, and program ``b`` keeps its rows in
its own slab of the symmetric buffer (``b * slab`` onwards, whatever the width), so calls of other row
counts or widths on the same buffer (two models on one group) never write where another program's peer
may still read. A call launches one program per row up to ``programs`` (a decode step of one request: one
program), and every rank launches the same programs for the same rows. The protocol, per program ``b``:

1. wait until every peer's program ``b`` has finished reading what this program wrote the last time it
   ran (the ``done`` flags; set at start-up so the first call passes). Only program ``b`` writes and reads
   rows ``b, b + programs, ...``, so a call that launched fewer programs left those rows alone;
2. copy this rank's rows of the partial into its symmetric buffer;
3. signal ``ready`` to every peer, wait for every peer's ``ready``;
4. read every rank's rows, reduce, add, norm, write the outputs;
5. signal ``done`` to every peer.

Flags are one 32-bit word each in a symmetric array. Thread 0 of a program does a program's flag work,
as torch's own symmetric-memory kernels do: it sets a peer's flag with a release store at system scope
after a barrier of the program's threads (so their writes and reads come before it), and waits on its
own with acquire loads, clearing each flag it saw, before a barrier releases the other threads. A wait
that sees nothing for :data:`WAIT_LIMIT_NS` traps (a CUDA error) instead of hanging the GPU when a peer
is gone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["WAIT_LIMIT_NS", "all_reduce_add", "build"]

#: How long a program waits for a peer's flag before it traps: 600 s, NCCL's default timeout. Ranks may be
#: minutes apart while one still loads its weights and the other already warms up; a rank that is gone is
#: found by the host's monitor within seconds (the server fails the requests and exits), and this limit
#: only keeps a GPU from spinning for ever. The wait's PTX below spells the same number.
WAIT_LIMIT_NS = 600_000_000_000


@triton.jit
def _wait_flag(addr):
    # Thread 0 of the program spins on one flag until it reads 1 (acquire, system scope), then clears it;
    # it traps past the time limit. The other threads wait at the barrier that follows every call, as
    # torch's own symmetric-memory kernels do: one thread per flag, not one per thread (a release or
    # acquire at system scope from every thread of 32 programs costs microseconds a call). Braces scope
    # the labels: the block is emitted once per peer.
    return tl.inline_asm_elementwise(
        """
        {
            .reg .u32 %thread, %flag;
            .reg .u64 %start, %now;
            .reg .pred %lead, %set, %late;
            mov.u32 %thread, %tid.x;
            setp.eq.u32 %lead, %thread, 0;
            @!%lead bra wait_done;
            mov.u64 %start, %globaltimer;
        wait_again:
            ld.acquire.sys.global.u32 %flag, [$1];
            setp.eq.u32 %set, %flag, 1;
            @%set bra wait_clear;
            mov.u64 %now, %globaltimer;
            sub.u64 %now, %now, %start;
            setp.gt.u64 %late, %now, 600000000000;
            @%late trap;
            bra wait_again;
        wait_clear:
            st.relaxed.sys.global.u32 [$1], 0;
        wait_done:
            mov.u32 $0, 0;
        }
        """,
        "=r,l",
        args=[addr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _set_flag(addr):
    # Thread 0 of the program sets one flag with a release store at system scope: the program's earlier
    # writes and reads (ordered before it by the barrier that precedes every call) happen before it for
    # whoever acquires the flag.
    return tl.inline_asm_elementwise(
        """
        {
            .reg .u32 %thread;
            .reg .pred %lead;
            mov.u32 %thread, %tid.x;
            setp.eq.u32 %lead, %thread, 0;
            @%lead st.release.sys.global.u32 [$1], 1;
            mov.u32 $0, 0;
        }
        """,
        "=r,l",
        args=[addr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# rows is not specialised on (Triton would build a variant for 1, for multiples of 16 and for the rest):
# one build per model width and norm flag, made at set-up (build()), never while serving.
@triton.jit(do_not_specialize=["rows", "slab"])
def _all_reduce_add_kernel(
    partial_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    total_ptr,
    local_ptr,  # this rank's symmetric data buffer (the partial's dtype)
    buffer_bases,  # int64 [world]: every rank's data buffer address
    flag_bases,  # int64 [world]: every rank's flag array address (int32 words)
    rows,
    n_cols,
    slab,  # elements of the symmetric buffer each program owns: program b's rows start at b * slab
    stride_p,
    stride_r,
    stride_n,
    stride_t,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = partial_ptr.dtype.element_ty

    own = tl.cast(pid, tl.int64) * slab  # where this program's rows start in every rank's buffer
    local_flags = tl.load(flag_bases + RANK)  # this rank's flag array (int64 address)
    done_here = local_flags + 4 * (PROGRAMS * WORLD + pid * WORLD)  # + 4 * peer: that peer's done
    ready_here = local_flags + 4 * (pid * WORLD)  # + 4 * peer: that peer's ready

    # 1. every peer done reading this program's rows of the previous call (each flag cleared as seen).
    for p in tl.static_range(WORLD):
        if p != RANK:
            _wait_flag(done_here + 4 * p)
    tl.debug_barrier()

    # 2. this rank's rows into its symmetric buffer.
    for row in range(pid, rows, PROGRAMS):
        r64 = tl.cast(row, tl.int64)
        x = tl.load(partial_ptr + r64 * stride_p + cols, mask=mask, other=0.0)
        tl.store(local_ptr + own + (r64 // PROGRAMS) * n_cols + cols, x, mask=mask)

    # 3. ready: every thread's copy before the release stores, every peer's before any read.
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != RANK:
            _set_flag(tl.load(flag_bases + p) + 4 * (pid * WORLD + RANK))
    for p in tl.static_range(WORLD):
        if p != RANK:
            _wait_flag(ready_here + 4 * p)
    tl.debug_barrier()

    # 4. reduce in rank order, add the residual, norm.
    for row in range(pid, rows, PROGRAMS):
        r64 = tl.cast(row, tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                x = tl.load(partial_ptr + r64 * stride_p + cols, mask=mask, other=0.0)
            else:
                base = tl.load(buffer_bases + p).to(tl.pointer_type(dtype))
                x = tl.load(base + own + (r64 // PROGRAMS) * n_cols + cols, mask=mask, other=0.0)
            acc += x.to(tl.float32)
        summed = acc.to(dtype).to(tl.float32)
        res = tl.load(residual_ptr + r64 * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        total = (summed + res).to(dtype)
        tl.store(total_ptr + r64 * stride_t + cols, total, mask=mask)
        if HAS_NORM:
            tf = total.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(tf * tf, axis=0) / n_cols + eps)
            y = (tf * rstd).to(dtype).to(tl.float32)
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(normed_ptr + r64 * stride_n + cols, (w * y).to(dtype), mask=mask)

    # 5. done reading the peers' rows: they may overwrite them.
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != RANK:
            _set_flag(tl.load(flag_bases + p) + 4 * (PROGRAMS * WORLD + pid * WORLD + RANK))


def build(width: int, dtype: torch.dtype, *, rank: int, world_size: int, programs: int) -> None:
    """Build (or load from Triton's cache) both forms of the kernel, with and without the norm, for rows of
    ``width`` columns of ``dtype``, without launching them: a model calls it at construction so no build
    happens while it serves (a Triton build on one thread while another builds is not safe)."""
    for norm in (True, False):
        _all_reduce_add_kernel.warmup(
            *([dtype] * 6),
            torch.int64,
            torch.int64,
            1,
            width,
            width,  # slab (not specialised)
            width,
            width,
            width,
            width,
            1e-6,
            grid=(programs,),
            RANK=rank,
            WORLD=world_size,
            PROGRAMS=programs,
            HAS_NORM=norm,
            BLOCK=triton.next_power_of_2(width),
            num_warps=4,
        )


def all_reduce_add(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    local: torch.Tensor,
    buffer_bases: torch.Tensor,
    flag_bases: torch.Tensor,
    rank: int,
    world_size: int,
    programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + sum(partials)) * weight, residual + sum(partials))`` for ``[N, H]`` rows (the
    first is an empty tensor when ``weight`` is None). ``local``, ``buffer_bases`` and ``flag_bases`` are
    the group's symmetric state (:class:`devgraph.reference.tp.comm.FusedAllReduce`); each of ``local``'s
    ``programs`` slabs holds the rows of its program (``ceil(N / programs) * H`` elements). Every rank
    calls it with the same shapes."""
    rows, cols = partial.shape
    total = torch.empty((rows, cols), device=partial.device, dtype=partial.dtype)
    normed = torch.empty_like(total) if weight is not None else total.new_empty((0, cols))
    _all_reduce_add_kernel[(min(rows, programs),)](
        partial,
        residual,
        weight if weight is not None else partial,
        normed if weight is not None else total,
        total,
        local,
        buffer_bases,
        flag_bases,
        rows,
        cols,
        local.numel() // programs,
        partial.stride(0),
        residual.stride(0),
        normed.stride(0) if weight is not None else total.stride(0),  # as build() specialises it
        total.stride(0),
        eps,
        RANK=rank,
        WORLD=world_size,
        PROGRAMS=programs,
        HAS_NORM=weight is not None,
        BLOCK=triton.next_power_of_2(cols),
        num_warps=4,  # as triton_fused.rms_norm launches: the same layout sums the squares in its order
    )
    return normed, total
