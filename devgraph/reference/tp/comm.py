"""The tensor-parallel reference model's collectives: all-reduce after each row-parallel linear, all-gather
of the vocab-parallel logits.

Two ways to issue them (``comm=``), both captured inside device graphs:

* ``torch``: ``torch.distributed.all_reduce`` / ``all_gather_into_tensor`` on the process group, as most
  engines write it. A device graph captures the NCCL kernels; under ``torch.compile`` (``tc_piecewise``,
  ``full`` with a compiler) dynamo rewrites the calls into functional collectives.
* ``op``: the same calls inside two torch custom ops, ``devgraph_tp::all_reduce`` and
  ``devgraph_tp::all_gather``, which dynamo keeps opaque: how engines hand their own communicator (a custom
  all-reduce) to ``torch.compile``. The op bodies go through the simulator's ``record_opaque``, so on the
  CPU each collective is recorded as one replay step that runs the collective again and waits for it.
* ``auto`` (default): ``op`` on the CPU, ``torch`` elsewhere. The CPU simulator cannot record a c10d
  collective op itself yet (docs/tensor-parallel.md says what fails), so CPU runs take the ``op`` path.
* ``symm``: all-reduces through torch's symmetric memory (``torch.distributed._symmetric_memory``): one
  buffer per group, allocated and rendezvoused once at construction (every rank constructs together), and
  per call one kernel over NVLink P2P (``symm_mem::one_shot_all_reduce_copy_out``: the partial copied in and
  every peer's read back, in place) for messages up to :data:`SYMM_ONE_SHOT_MAX_BYTES`, the two-shot op up
  to the buffer's size, NCCL beyond (and for the all-gather). The call sits inside the custom op
  ``devgraph_tp::symm_all_reduce`` (opaque to dynamo, like ``op``). No multicast (NVLS) needed. Where
  symmetric memory cannot be used (the CPU, gloo, one rank, no peer access, a dtype its kernels lack, a torch
  without the ops, a failed rendezvous or self-test on any rank) every rank falls back to what ``auto``
  picks, and one log line says why (:attr:`TPComm.fallback_reason`).

  Under ``symm``, where Triton runs, a layer's all-reduce and what follows it (the residual add, and after
  attention the next RMSNorm) are one kernel (:class:`FusedAllReduce`,
  :mod:`devgraph.reference.tp.triton_all_reduce`) for steps of up to :data:`FUSED_MAX_ROWS` rows: the op
  ``devgraph_tp::symm_all_reduce_add`` (:meth:`TPComm.all_reduce_add`). It has its own symmetric buffer and
  flags, self-tested against the unfused path at construction; where it cannot be used (no Triton, a
  failed self-test on any rank) the unfused path runs and :attr:`TPComm.fused_reason` says why.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch

from devgraph import ConfigError
from devgraph.platforms.sim.graph import record_opaque

__all__ = [
    "COMM_MODES",
    "FUSED_MAX_ROWS",
    "FusedAllReduce",
    "SYMM_BUFFER_MAX_BYTES",
    "SYMM_ONE_SHOT_MAX_BYTES",
    "SymmBuffer",
    "TPComm",
    "symm_plan",
    "symm_unavailable_reason",
]

logger = logging.getLogger(__name__)

COMM_MODES: tuple[str, ...] = ("auto", "torch", "op", "symm")

# ``symm``: the symmetric buffer holds at most this many bytes (messages beyond it go to NCCL, where
# bandwidth, not the per-call latency, decides); one-shot up to SYMM_ONE_SHOT_MAX_BYTES, two-shot above.
# 8 MiB: 1024 tokens of a 4096-wide bf16 hidden state. The one-shot limit is a first guess (vLLM and SGLang
# pick by size tables too); benchmarks/bench_tp_comm.py times both ops at each size to set it.
SYMM_BUFFER_MAX_BYTES = 8 << 20
SYMM_ONE_SHOT_MAX_BYTES = 512 << 10
# The dtypes torch's one-/two-shot kernels dispatch on (AT_DISPATCH_FLOAT_AND_BFLOAT16).
SYMM_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
_ALIGN = 16  # the kernels' widest vector; a partial at a 16-byte offset takes the fused one-kernel path

# The fused all-reduce (FusedAllReduce) takes steps of up to this many rows (tokens): it launches at most
# FUSED_PROGRAMS programs, each reducing its rows one after another, so a long prefill is better served by
# the unfused path's wide kernels. 128 rows covers decode batches up to 128. A first choice, not a tuned
# one: benchmarks/bench_tp_comm.py times both paths in a decode step at batch 1 and 64 only (the fused one
# 0.97-0.98x there, docs/tensor-parallel.md); where the two cross between 64 and 128 rows is not measured.
FUSED_MAX_ROWS = 128
FUSED_PROGRAMS = 32
# The widest hidden size the fused kernel keeps in one program's registers (a row per program at a time).
FUSED_MAX_COLS = 16384

# Process groups the custom ops may name (an op's schema takes the group's name, not the object).
_groups: dict[str, Any] = {}
# The symmetric buffers the ``symm`` op may name, by key (group, dtype, size).
_symm_buffers: dict[str, SymmBuffer] = {}
# The fused all-reduces the ``symm_all_reduce_add`` op may name, by key (group, dtype, size).
_fused_buffers: dict[str, FusedAllReduce] = {}


def _all_reduce_now(tensor: torch.Tensor, group: Any) -> None:
    torch.distributed.all_reduce(tensor, group=group)


# torch >= 2.13 names it all_gather_single (and warns on the old name); dynamo rewrites either one.
_gather_into = (
    getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
)


def _all_gather_now(tensor: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
    out = tensor.new_empty((world_size * tensor.shape[0], *tensor.shape[1:]))
    _gather_into(out, tensor.contiguous(), group=group)
    return out


@torch.library.custom_op("devgraph_tp::all_reduce", mutates_args=("tensor",))
def _all_reduce_op(tensor: torch.Tensor, group_name: str) -> None:
    # Outside a CPU-simulator capture record_opaque just calls; a device graph captures the NCCL kernel.
    record_opaque(_all_reduce_now, tensor, _groups[group_name])


@_all_reduce_op.register_fake
def _(tensor, group_name):  # type: ignore[no-untyped-def]
    return None


@torch.library.custom_op("devgraph_tp::all_gather", mutates_args=())
def _all_gather_op(tensor: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return record_opaque(_all_gather_now, tensor, _groups[group_name], world_size)


@_all_gather_op.register_fake
def _(tensor, group_name, world_size):  # type: ignore[no-untyped-def]
    return tensor.new_empty((world_size * tensor.shape[0], *tensor.shape[1:]))


@torch.library.custom_op("devgraph_tp::symm_all_reduce", mutates_args=("tensor",))
def _symm_all_reduce_op(tensor: torch.Tensor, key: str) -> None:
    # Host work per call: choosing the plan and the ops' cached rendezvous lookup; nothing that syncs, so
    # a device graph captures the kernels (one for a one-shot message) and replays them as they are.
    _symm_buffers[key].all_reduce(tensor)


@_symm_all_reduce_op.register_fake
def _(tensor, key):  # type: ignore[no-untyped-def]
    return None


@torch.library.custom_op("devgraph_tp::symm_all_reduce_add", mutates_args=())
def _symm_all_reduce_add_op(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],  # noqa: UP045 - torch derives the op schema from it
    eps: float,
    key: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_buffers[key].all_reduce_add(partial, residual, weight, eps)


@_symm_all_reduce_add_op.register_fake
def _(partial, residual, weight, eps, key):  # type: ignore[no-untyped-def]
    normed = torch.empty_like(partial) if weight is not None else partial.new_empty((0, partial.shape[1]))
    return normed, torch.empty_like(partial)


# -- symmetric memory ------------------------------------------------------------------------------------
def symm_plan(
    nbytes: int,
    dtype: torch.dtype,
    *,
    buffer_dtype: torch.dtype | None,
    capacity: int,
    one_shot_max: int = SYMM_ONE_SHOT_MAX_BYTES,
    contiguous: bool = True,
    aligned: bool = True,
    fused_copy: bool = True,
    world_size: int = 2,
) -> str:
    """How ``symm`` all-reduces a message of ``nbytes`` bytes of ``dtype`` (every rank computes the same):

    * ``"one_shot_copy"``: one kernel, ``one_shot_all_reduce_copy_out`` (copies the partial into the
      symmetric buffer, reads every peer's, writes the sum back in place); needs a 16-byte aligned partial;
    * ``"one_shot"``: the partial copied in, then ``one_shot_all_reduce_out`` into the partial (a torch
      without the fused op);
    * ``"two_shot_out"``: copy in, ``two_shot_all_reduce_out`` into the partial (2, 4 or 8 ranks);
    * ``"two_shot"``: copy in, ``two_shot_all_reduce_`` on the buffer, copy back;
    * ``"nccl"``: the message does not fit the buffer (``capacity`` bytes, 0: none), is not of the
      buffer's dtype, not contiguous, or not a whole number of 4-byte words (the kernels' smallest vector).
    """
    if capacity <= 0 or buffer_dtype is None or dtype != buffer_dtype or not contiguous:
        return "nccl"
    if nbytes <= 0 or nbytes > capacity or nbytes % 4:
        return "nccl"
    if nbytes <= one_shot_max:
        if aligned:
            return "one_shot_copy" if fused_copy else "one_shot"
        return "two_shot"
    return "two_shot_out" if aligned and world_size in (2, 4, 8) else "two_shot"


def symm_unavailable_reason(
    *, device: torch.device, backend: str | None, world_size: int, dtype: torch.dtype | None
) -> str | None:
    """Why this rank cannot use ``symm`` on its own (``None``: it may try); what every rank can see
    alike. The rest (the ops, peer access, the rendezvous) is found out collectively (``_setup_symm``)."""
    if world_size < 2:
        return "one rank: nothing to all-reduce"
    if device.type != "cuda":
        return f"symmetric memory needs CUDA devices; this rank runs on {device.type}"
    if backend is None or "nccl" not in backend.lower():
        return (
            f"the process group's backend is {backend!r}; symm needs a NCCL group (its fallback and checks)"
        )
    if dtype not in SYMM_DTYPES:
        return f"torch's one-/two-shot kernels take bfloat16 or float32; the model's dtype is {dtype}"
    return None


def _symm_ops_missing() -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:  # a torch built without distributed or without symmetric memory
        return f"torch.distributed._symmetric_memory cannot be imported ({exc})"
    if not hasattr(symm_mem, "empty") or not hasattr(symm_mem, "rendezvous"):
        return f"torch {torch.__version__} has no symm_mem.empty / rendezvous (torch >= 2.6 has)"
    ops = torch.ops.symm_mem
    missing = [n for n in ("one_shot_all_reduce_out", "two_shot_all_reduce_") if not hasattr(ops, n)]
    if missing:
        return f"torch {torch.__version__} lacks torch.ops.symm_mem.{', '.join(missing)}"
    return None


def _agree(ok: bool, group: Any, device: torch.device) -> bool:
    """Whether every rank of ``group`` says ``ok`` (one small all-reduce on the group; collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _peer_access_problem(group: Any, device: torch.device, world_size: int) -> str | None:
    """Each rank's device index gathered (collective); where all the group's devices are visible here, any
    pair without CUDA peer access. Ranks that each see one device (CUDA_VISIBLE_DEVICES per rank) are left
    to the rendezvous and the self-test."""
    index = torch.tensor([device.index if device.index is not None else torch.cuda.current_device()])
    gathered = torch.empty(world_size, dtype=torch.int64, device=device)
    _gather_into(gathered, index.to(device=device, dtype=torch.int64), group=group)
    indices = [int(i) for i in gathered.tolist()]
    if len(set(indices)) != len(indices) or max(indices) >= torch.cuda.device_count():
        return None
    for a in indices:
        for b in indices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"cuda:{a} has no peer access to cuda:{b} (no NVLink / P2P between them)"
    return None


class SymmBuffer:
    """One group's symmetric buffer (``capacity`` bytes of ``dtype``), rendezvoused, and the all-reduce
    over it. Build it with :meth:`create` (collective: every rank of the group, together)."""

    def __init__(self, buffer: torch.Tensor, handle: Any, group: Any, key: str, one_shot_max: int) -> None:
        self.buffer = buffer  # flat, symmetric (symm_mem.empty), rendezvoused on ``group``
        self.handle = handle
        self.group = group
        self.group_name: str = group.group_name
        self.key = key
        self.world_size = torch.distributed.get_world_size(group)
        self.capacity = buffer.numel() * buffer.element_size()
        self.one_shot_max = one_shot_max
        self.fused_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        self.multicast = bool(getattr(handle, "multicast_ptr", 0))

    @classmethod
    def create(
        cls, group: Any, device: torch.device, dtype: torch.dtype, capacity: int, one_shot_max: int
    ) -> SymmBuffer:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        if torch.torch_version.TorchVersion(torch.__version__) < (2, 11):  # type: ignore[operator]
            # Before 2.11 the group had to be registered first; 2.11 deprecates it (resolves the group
            # itself) and later releases remove it.
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(name)
        numel = max(1, capacity // torch.empty((), dtype=dtype).element_size())
        numel -= numel % 8  # 16-byte multiple for bf16 and fp32
        buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        buffer.zero_()
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(buffer, name)
        key = f"{name}/{dtype}/{numel}"
        return cls(buffer, handle, group, key, one_shot_max)

    def plan(self, tensor: torch.Tensor) -> str:
        offset = tensor.storage_offset() * tensor.element_size()
        return symm_plan(
            tensor.numel() * tensor.element_size(),
            tensor.dtype,
            buffer_dtype=self.buffer.dtype,
            capacity=self.capacity,
            one_shot_max=self.one_shot_max,
            contiguous=tensor.is_contiguous(),
            aligned=offset % _ALIGN == 0 and tensor.data_ptr() % _ALIGN == 0,
            fused_copy=self.fused_copy,
            world_size=self.world_size,
        )

    def all_reduce(self, tensor: torch.Tensor, plan: str | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (``plan``: :func:`symm_plan`'s answer, forced)."""
        plan = plan or self.plan(tensor)
        ops = torch.ops.symm_mem
        if plan == "nccl":
            torch.distributed.all_reduce(tensor, group=self.group)
            return tensor
        flat = tensor.view(-1)
        staged = self.buffer[: flat.numel()]
        if plan == "one_shot_copy":
            # The kernel reads the partial before the barrier and writes the sum after it, each thread over
            # the same elements, so ``out`` may be the partial itself.
            ops.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
            return tensor
        staged.copy_(flat)
        if plan == "one_shot":
            ops.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        elif plan == "two_shot_out":
            ops.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        elif plan == "two_shot":
            ops.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
        else:
            raise ConfigError(f"symm plan {plan!r} is unknown; accepted: see devgraph.reference.tp.symm_plan")
        return tensor

    def self_test(self, rank: int) -> str | None:
        """Each plan once, eagerly, on known values (collective); what went wrong here, if anything."""
        hidden = 64
        rows = {"one_shot_copy" if self.fused_copy else "one_shot": 2}
        big = (self.one_shot_max // (hidden * self.buffer.element_size())) + 2
        if big * hidden * self.buffer.element_size() <= self.capacity:
            rows["two_shot_out" if self.world_size in (2, 4, 8) else "two_shot"] = big
        want = sum(r + 1 for r in range(self.world_size))
        for plan, n in rows.items():
            x = torch.full((n, hidden), float(rank + 1), dtype=self.buffer.dtype, device=self.buffer.device)
            x[:, 1::2] *= 2
            self.all_reduce(x, plan)
            expected = torch.full_like(x, float(want))
            expected[:, 1::2] *= 2
            if not torch.equal(x, expected):
                bad = (x != expected).sum().item()
                return f"self-test {plan} on {n}x{hidden}: {bad} of {x.numel()} values wrong"
        torch.cuda.synchronize(self.buffer.device)
        return None

    def __repr__(self) -> str:
        return (
            f"SymmBuffer(group={self.group_name!r}, {self.capacity >> 10} KiB {self.buffer.dtype}, "
            f"one-shot <= {self.one_shot_max >> 10} KiB, fused copy {self.fused_copy}, "
            f"multicast {self.multicast})"
        )


def _peer_addresses(handle: Any, tensor: torch.Tensor, rank: int) -> list[int]:
    """Every rank's address of ``tensor``'s symmetric allocation. A handle's ``buffer_ptrs`` are the
    mappings' bases; torch may place a tensor at an ``offset`` into its allocation (a pool split), which
    every rank shares: this rank's own address tells which, and an address it cannot account for is
    refused (the unfused path) rather than written through."""
    bases = [int(p) for p in handle.buffer_ptrs]
    offset = int(getattr(handle, "offset", 0) or 0)
    for shift in dict.fromkeys((0, offset)):
        if bases[rank] + shift == tensor.data_ptr():
            return [base + shift for base in bases]
    raise ConfigError(
        f"symmetric memory: this rank's tensor is at {tensor.data_ptr():#x}, its handle's base "
        f"{bases[rank]:#x} and offset {offset}; the fused all-reduce cannot locate the peers' copies"
    )


class FusedAllReduce:
    """A group's fused all-reduce (``sum + residual``, optionally RMS-normed) in one Triton kernel
    (:mod:`devgraph.reference.tp.triton_all_reduce`), with its own symmetric data buffer and flag array
    (never shared with torch's ops, whose barriers use their own signal pads). Build it with
    :meth:`create` (collective)."""

    def __init__(
        self, data: torch.Tensor, flags: torch.Tensor, data_handle: Any, flag_handle: Any, key: str
    ) -> None:
        self.data = data  # flat, symmetric: this rank's rows of a call's partial
        self.flags = flags  # int32, symmetric: [2, programs, world] ready and done flags
        # The handles keep the peers' mappings alive as long as the pointers below are used.
        self._handles = (data_handle, flag_handle)
        device = data.device
        self.rank: int = data_handle.rank
        self.world_size: int = data_handle.world_size
        bases = _peer_addresses(data_handle, data, self.rank)
        flag_bases = _peer_addresses(flag_handle, flags, self.rank)
        self.buffer_bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self.flag_bases = torch.tensor(flag_bases, dtype=torch.int64, device=device)
        self.key = key
        self.programs = FUSED_PROGRAMS
        self.max_rows = FUSED_MAX_ROWS

    @classmethod
    def create(cls, group: Any, device: torch.device, dtype: torch.dtype, capacity: int) -> FusedAllReduce:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        world = torch.distributed.get_world_size(group)
        numel = max(8, capacity // torch.empty((), dtype=dtype).element_size())
        numel -= numel % 8
        data = symm_mem.empty(numel, dtype=dtype, device=device)
        data.zero_()
        flags = symm_mem.empty(2 * FUSED_PROGRAMS * world, dtype=torch.int32, device=device)
        flags.zero_()
        rank = torch.distributed.get_rank(group)
        done = flags.view(2, FUSED_PROGRAMS, world)[1]
        done.fill_(1)  # every peer "done" with the call before the first: the first call passes step 1
        done[:, rank] = 0
        torch.cuda.synchronize(device)
        data_handle = symm_mem.rendezvous(data, name)
        flag_handle = symm_mem.rendezvous(flags, name)
        torch.cuda.synchronize(device)
        return cls(data, flags, data_handle, flag_handle, f"{name}/{dtype}/{numel}/fused")

    def fits(self, partial: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether a call with these tensors takes the fused kernel (every rank decides alike: the same
        shapes, dtypes and layouts on every rank)."""
        if partial.dim() != 2 or residual.shape != partial.shape:
            return False
        rows, cols = partial.shape
        if not isinstance(rows, int):  # symbolic under torch.compile: no guard on it, the unfused path
            return False
        per_program = -(-rows // self.programs)  # rows of the busiest program, in its own slab
        return (
            0 < rows <= self.max_rows
            and cols <= FUSED_MAX_COLS
            and per_program * cols <= self.data.numel() // self.programs
            and partial.dtype == self.data.dtype == residual.dtype
            and partial.stride(1) == 1
            and residual.stride(1) == 1
            and partial.device == self.data.device
        )

    def all_reduce_add(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from devgraph.reference.tp.triton_all_reduce import all_reduce_add

        return all_reduce_add(
            partial,
            residual,
            weight,
            eps,
            local=self.data,
            buffer_bases=self.buffer_bases,
            flag_bases=self.flag_bases,
            rank=self.rank,
            world_size=self.world_size,
            programs=self.programs,
        )

    def build(self, width: int) -> None:
        """Build the kernel's forms for rows of ``width`` columns now, without launching them, so that no
        build happens while a model serves (a model calls it at construction)."""
        from devgraph.reference.tp.triton_all_reduce import build

        build(width, self.data.dtype, rank=self.rank, world_size=self.world_size, programs=self.programs)

    def self_test(self, cols: int, agree: Callable[[bool], bool]) -> str | None:
        """The fused kernel against a plain sum on known values (collective), with and without the norm,
        for one row and for the most rows it takes of ``cols`` columns (a width it was built for), new
        values every call; what went wrong here, if anything. The sums must be exact (the same additions
        in the same order); the norm within rounding (its sum of squares in another order). ``agree``:
        whether every rank says so (a collective); every rank agrees its inputs are ready before each
        launch, so a rank that cannot make them does not leave its peers' kernels waiting for its flags,
        and every rank runs every check (the first failure is kept, never returned early)."""
        device, rank = self.data.device, self.rank
        most = min(self.max_rows, (self.data.numel() // self.programs // cols) * self.programs)
        if most < 1:  # the same on every rank: one buffer size
            return f"its buffer ({self.data.numel()} elements) is too small for a row per program"
        failure: str | None = None
        for call, rows in enumerate(r for r in (1, 1, most, 3) if r <= most):
            made: tuple[torch.Tensor, ...] | None = None
            try:
                made = self._test_values(rows, cols, 1234 + call)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory: no launch on any rank
                failure = failure or f"fused self-test could not make its values: {type(exc).__name__}: {exc}"
            if not agree(made is not None):
                return failure or "another rank could not make the fused self-test's values"
            assert made is not None
            everyone, residual, weight, want_total, want_normed = made
            normed, total = self.all_reduce_add(everyone[rank].contiguous(), residual, weight, 1e-6)
            _, plain = self.all_reduce_add(everyone[rank].contiguous(), residual, None, 1e-6)
            torch.cuda.synchronize(device)
            # A stale or missing peer row is off by whole units, and so is a row read before it was written.
            if not (torch.equal(total, want_total) and torch.equal(plain, want_total)):
                failure = failure or f"fused self-test on {rows}x{cols}: the sums differ from the plain sum"
            elif not torch.allclose(normed.float(), want_normed.float(), rtol=1e-2, atol=1e-2):
                failure = failure or f"fused self-test on {rows}x{cols}: the norm differs from the plain norm"
        return failure

    def _test_values(self, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Every rank's partials, a residual, a norm weight, and the sums and norm they must give."""
        device, dtype = self.data.device, self.data.dtype
        generator = torch.Generator(device=device).manual_seed(seed)
        everyone = torch.randn(
            (self.world_size, rows, cols), generator=generator, device=device, dtype=torch.float32
        ).to(dtype)
        residual = torch.randn((rows, cols), generator=generator, device=device).to(dtype)
        weight = torch.rand(cols, generator=generator, device=device).to(dtype)
        summed = everyone[0].float()
        for other in everyone[1:]:  # rank order, in float32, as the kernel adds
            summed = summed + other.float()
        want_total = (summed.to(dtype).float() + residual.float()).to(dtype)
        tf = want_total.float()
        scaled = (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
        want_normed = (weight.float() * scaled).to(dtype)
        return everyone, residual, weight, want_total, want_normed

    def __repr__(self) -> str:
        return (
            f"FusedAllReduce({self.data.numel() * self.data.element_size() >> 10} KiB {self.data.dtype}, "
            f"{self.programs} programs, <= {self.max_rows} rows)"
        )


def _setup_symm(
    group: Any, device: torch.device, dtype: torch.dtype | None, capacity: int, one_shot_max: int, rank: int
) -> tuple[SymmBuffer | None, str | None]:
    """The group's symmetric buffer, or why not. Every rank calls it; every rank gets the same outcome
    (the checks that could differ between ranks are agreed on before the next collective step)."""
    world_size = torch.distributed.get_world_size(group)
    try:
        backend: str | None = str(torch.distributed.get_backend(group))
    except Exception:  # noqa: BLE001 - a group torch cannot name a backend for: fall back
        backend = None
    reason = symm_unavailable_reason(device=device, backend=backend, world_size=world_size, dtype=dtype)
    if reason is not None:  # the same on every rank (one model config, one backend, one device type)
        return None, reason
    assert dtype is not None
    local = _symm_ops_missing()
    try:  # collective: every rank gathers, whatever it found above
        peer = _peer_access_problem(group, device, world_size)
    except Exception as exc:  # noqa: BLE001 - a failed check is a reason, never a failed model
        peer = f"checking peer access failed: {type(exc).__name__}: {exc}"
    local = local or peer
    if not _agree(local is None, group, device):
        return None, local or "another rank cannot use symmetric memory (its log says why)"
    size = min(capacity, SYMM_BUFFER_MAX_BYTES)
    key_probe = f"{group.group_name}/{dtype}/"
    for existing in _symm_buffers.values():  # another model on this group: share its buffer
        if existing.key.startswith(key_probe) and existing.capacity >= size:
            existing.one_shot_max = one_shot_max
            return existing, None
    buffer: SymmBuffer | None = None
    try:
        buffer = SymmBuffer.create(group, device, dtype, size, one_shot_max)
    except Exception as exc:  # noqa: BLE001 - allocation or rendezvous failed: fall back
        local = f"symmetric-memory allocation or rendezvous failed: {type(exc).__name__}: {exc}"
    if not _agree(buffer is not None, group, device):
        return None, local or "the rendezvous failed on another rank (its log says why)"
    assert buffer is not None
    try:
        local = buffer.self_test(rank)
    except Exception as exc:  # noqa: BLE001 - an op refused the buffer (alignment, dtype, an old torch)
        local = f"self-test raised {type(exc).__name__}: {exc}"
    if not _agree(local is None, group, device):
        return None, local or "the self-test failed on another rank (its log says why)"
    _symm_buffers[buffer.key] = buffer
    return buffer, None


def _setup_fused(
    group: Any, device: torch.device, dtype: torch.dtype, capacity: int, width: int | None
) -> tuple[FusedAllReduce | None, str | None]:
    """The group's fused all-reduce, or why not (collective, after ``symm`` was set up on every rank):
    shared with another model on the group where its buffer is large enough, else made and self-tested;
    its kernel built for ``width`` columns (the model's hidden size; 256 without one) on every rank before
    any launch, and self-tested at that width."""
    local: str | None = None
    try:
        import devgraph.reference.tp.triton_all_reduce  # noqa: F401
    except ImportError as exc:
        local = f"the fused all-reduce needs Triton ({exc}); pip install triton"
    if not _agree(local is None, group, device):
        return None, local or "Triton is missing on another rank (its log says why)"
    size = min(capacity, FUSED_MAX_ROWS * FUSED_MAX_COLS * torch.empty((), dtype=dtype).element_size())
    key_probe = f"{group.group_name}/{dtype}/"
    shared = next(
        (
            existing
            for existing in _fused_buffers.values()  # another model on this group: share its buffer
            if existing.key.startswith(key_probe)
            and existing.data.numel() * existing.data.element_size() >= size
        ),
        None,
    )
    fused: FusedAllReduce | None = shared
    if fused is None:
        try:
            fused = FusedAllReduce.create(group, device, dtype, size)
        except Exception as exc:  # noqa: BLE001 - allocation or rendezvous failed: the unfused path
            local = f"the fused all-reduce's allocation or rendezvous failed: {type(exc).__name__}: {exc}"
        if not _agree(fused is not None, group, device):
            return (
                None,
                local or "the fused all-reduce's rendezvous failed on another rank (its log says why)",
            )
    assert fused is not None
    # Built on every rank before any launch: a rank that cannot build must not leave its peers waiting.
    width = width or 256
    try:
        fused.build(width)
    except Exception as exc:  # noqa: BLE001 - the kernel does not build here
        local = f"the fused all-reduce's kernel does not build: {type(exc).__name__}: {exc}"
    if not _agree(local is None, group, device):
        return (
            None,
            local or "the fused all-reduce's kernel does not build on another rank (its log says why)",
        )
    if shared is not None:
        return shared, None
    try:
        local = fused.self_test(width, lambda ok: _agree(ok, group, device))
    except Exception as exc:  # noqa: BLE001 - the kernel failed to run here
        local = f"the fused all-reduce's self-test raised {type(exc).__name__}: {exc}"
    if not _agree(local is None, group, device):
        return None, local or "the fused all-reduce's self-test failed on another rank (its log says why)"
    _fused_buffers[fused.key] = fused
    return fused, None


class TPComm:
    """The collectives of one tensor-parallel rank over ``group`` (``None``: one rank, no collectives).

    ``dtype`` and ``max_bytes`` size the ``symm`` mode's buffer (the model's dtype; its largest all-reduce,
    capped at :data:`SYMM_BUFFER_MAX_BYTES`); ``symm_one_shot_max`` its one-shot limit. Asking for
    ``symm`` is collective: every rank of the group constructs its TPComm together. ``fuse``: under
    ``symm``, also set up the fused all-reduce (:meth:`all_reduce_add`; a model running the Triton
    kernels asks for it), its kernel built for rows of ``fuse_width`` columns (the model's hidden size) at
    construction, so none is built while the model serves.
    """

    def __init__(
        self,
        group: Any,
        comm: str = "auto",
        device: torch.device | None = None,
        *,
        dtype: torch.dtype | None = None,
        max_bytes: int = SYMM_BUFFER_MAX_BYTES,
        symm_one_shot_max: int = SYMM_ONE_SHOT_MAX_BYTES,
        fuse: bool = False,
        fuse_width: int | None = None,
    ) -> None:
        if comm not in COMM_MODES:
            raise ConfigError(f"comm={comm!r} is unknown; accepted: {', '.join(COMM_MODES)}")
        distributed = group is not None and torch.distributed.is_initialized()
        if group is not None and not distributed:
            raise ConfigError(
                "a process group was given but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first (torchrun sets the environment it reads)"
            )
        self.group = group
        self.world_size = torch.distributed.get_world_size(group) if distributed else 1
        self.rank = torch.distributed.get_rank(group) if distributed else 0
        device = device if device is not None else torch.device("cpu")
        auto = "op" if device.type == "cpu" else "torch"
        self.requested = comm
        self.mode = comm if comm not in ("auto", "symm") else auto
        self.group_name = group.group_name if distributed else ""
        self.symm: SymmBuffer | None = None
        self.fallback_reason: str | None = None  # why ``symm`` was asked for and not used
        self.fused: FusedAllReduce | None = None
        self.fused_reason: str | None = None  # why the fused all-reduce was asked for and not used
        if comm == "symm":
            if distributed:
                self.symm, self.fallback_reason = _setup_symm(
                    group, device, dtype, max_bytes, symm_one_shot_max, self.rank
                )
            else:
                self.fallback_reason = "one rank: nothing to all-reduce"
            if self.symm is not None:
                self.mode = "symm"
                # Agreed first: _setup_fused is collective, and a rank without Triton asks for nothing.
                if _agree(fuse, group, device):
                    assert dtype is not None  # symm was set up: the model's dtype is known
                    self.fused, self.fused_reason = _setup_fused(group, device, dtype, max_bytes, fuse_width)
                elif fuse:
                    self.fused_reason = "another rank did not ask for it (no Triton there?)"
                if fuse and self.fused is None:
                    logger.warning(
                        "tensor-parallel all-reduce: the fused all-reduce + add + norm was asked and is not "
                        "used (rank %d): %s; the all-reduce and the add and norm run apart",
                        self.rank,
                        self.fused_reason,
                    )
                if self.rank == 0:
                    logger.info(
                        "tensor-parallel all-reduce: symmetric memory, %r; fused with the add and norm: %s",
                        self.symm,
                        self.fused if self.fused is not None else f"no ({self.fused_reason or 'not asked'})",
                    )
            elif distributed:
                logger.warning(
                    "tensor-parallel all-reduce: comm='symm' asked, using %r (rank %d): %s",
                    self.mode,
                    self.rank,
                    self.fallback_reason,
                )
        if distributed and self.mode in ("op", "symm"):
            _groups[self.group_name] = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return tensor
        if self.mode == "torch":
            torch.distributed.all_reduce(tensor, group=self.group)
        elif self.mode == "symm":
            assert self.symm is not None
            torch.ops.devgraph_tp.symm_all_reduce(tensor, self.symm.key)
        else:
            torch.ops.devgraph_tp.all_reduce(tensor, self.group_name)
        return tensor

    def all_reduce_add(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """``(normed, residual + sum of partial over the ranks)`` in one fused kernel, ``normed`` being
        RMSNorm(total) x ``weight`` (``None`` without a weight); ``None`` where the fused kernel does not
        take this call (not set up, or the step is larger than it takes): the caller all-reduces and adds
        itself. Every rank gets the same answer for the same shapes."""
        if self.fused is None or not self.fused.fits(partial, residual):
            return None
        normed, total = torch.ops.devgraph_tp.symm_all_reduce_add(
            partial, residual, weight, eps, self.fused.key
        )
        return (normed if weight is not None else None), total

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[N, C]`` on each rank -> ``[world_size * N, C]``, rank 0's rows first."""
        if self.world_size == 1:
            return tensor
        if self.mode in ("torch", "symm"):  # symm: one all-gather per step, NCCL's
            return _all_gather_now(tensor, self.group, self.world_size)
        return torch.ops.devgraph_tp.all_gather(tensor, self.group_name, self.world_size)

    def __repr__(self) -> str:
        extra = f", fallback_reason={self.fallback_reason!r}" if self.fallback_reason else ""
        extra += ", fused" if self.fused is not None else ""
        return f"TPComm(rank={self.rank}, world_size={self.world_size}, mode={self.mode!r}{extra})"
