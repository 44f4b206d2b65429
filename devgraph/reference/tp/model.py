"""The reference decoder sharded Megatron-style over a tensor-parallel process group.

Per layer: the fused q/k/v and gate/up projections are column-parallel (each rank holds its query heads,
its KV heads and its slice of the MLP), ``o_proj`` and ``down_proj`` are row-parallel and followed by an
all-reduce; each rank keeps the paged KV cache of its own KV heads. The embedding is replicated; the LM
head (tied to it) is vocab-parallel: each rank computes the logits of its slice of the vocabulary and an
all-gather assembles them.

The full weights are drawn exactly as :class:`~devgraph.reference.ReferenceModel` draws them (same seed,
same order) and each rank keeps its slice, so one rank equals the single-device model and two ranks equal
it up to the order of the all-reduce's sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from devgraph import ConfigError
from devgraph.reference.config import ReferenceConfig
from devgraph.reference.fused import fused_kernels, linear, set_up_triton
from devgraph.reference.kernel_builds import DecodeShapes
from devgraph.reference.model import (
    WEIGHT_INITS,
    DecoderLayer,
    LayerPart,
    ReferenceModel,
    RMSNorm,
    decoder_rope_tables,
)
from devgraph.reference.tp.comm import TPComm

__all__ = ["TPDecoderLayer", "TPReferenceModel", "rank_part"]

# Draws a full weight of ``shape`` with fan-in ``fan_in`` (float32), in the single-device model's order.
Draw = Callable[[tuple[int, ...], int], torch.Tensor]


def _drawer(seed: int, device: torch.device, exact: bool) -> Draw:
    """``exact``: on the CPU, as ReferenceModel draws (equal weights on any device); otherwise on
    ``device`` (fast for large shapes; the same on every rank of one device type)."""
    where = torch.device("cpu") if exact else device
    generator = torch.Generator(device=where).manual_seed(seed)

    def draw(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        weight = torch.randn(shape, generator=generator, dtype=torch.float32, device=where)
        return weight.mul_(1.0 / math.sqrt(fan_in))

    return draw


def _empty(device: torch.device) -> Draw:
    def draw(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=device)

    return draw


def _part(total: int, rank: int, size: int) -> slice:
    step = total // size
    return slice(rank * step, (rank + 1) * step)


def rank_part(config: ReferenceConfig, draw: Draw, rank: int, size: int, device: torch.device) -> LayerPart:
    """Rank ``rank``'s part of one layer (of ``size``): its query heads, its KV heads and its slice of the
    MLP, cut from the full weights ``draw`` gives in the single-device model's order (q/k/v, o, gate/up,
    down). The fused q/k/v and gate/up projections are column-parallel (this rank's rows of each part),
    ``o_proj`` and ``down_proj`` row-parallel (this rank's columns)."""
    c, dt = config, config.dtype
    q_full, kv_full = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def keep(weight: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(weight.contiguous().to(device=device, dtype=dt), requires_grad=False)

    q, k, v = draw((q_full + 2 * kv_full, c.hidden_size), c.hidden_size).split((q_full, kv_full, kv_full))
    heads, kv_heads = _part(q_full, rank, size), _part(kv_full, rank, size)
    qkv = torch.cat([q[heads], k[kv_heads], v[kv_heads]])
    o_proj = draw((c.hidden_size, q_full), q_full)[:, heads]
    gate, up = draw((2 * c.intermediate_size, c.hidden_size), c.hidden_size).chunk(2)
    mlp = _part(c.intermediate_size, rank, size)
    down = draw((c.hidden_size, c.intermediate_size), c.intermediate_size)[:, mlp]
    return LayerPart(
        num_heads=c.num_heads // size,
        num_kv_heads=c.num_kv_heads // size,
        qkv_proj=keep(qkv),
        o_proj=keep(o_proj),
        gate_up_proj=keep(torch.cat([gate[mlp], up[mlp]])),
        down_proj=keep(down),
    )


class TPDecoderLayer(DecoderLayer):
    """A :class:`DecoderLayer` holding one rank's heads and MLP slice (:func:`rank_part`); its
    :meth:`reduce` all-reduces after ``o_proj`` and ``down_proj``. Everything else, attention (``paged``
    or ``sdpa``, over the local heads) and the forward included, is the single-device layer's."""

    def __init__(self, config: ReferenceConfig, draw: Draw, comm: TPComm, device: torch.device) -> None:
        part = rank_part(config, draw, comm.rank, comm.world_size, device)
        super().__init__(config, None, device, part)
        self.comm = comm

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(partial)

    # With the Triton kernels and ``symm``, the all-reduce and the add (and norm) after it are one kernel
    # (TPComm.all_reduce_add) where the step fits it; the unfused path otherwise.
    def reduce_add_norm(
        self, partial: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self.comm.all_reduce_add(partial, residual, self.post_attention_norm.weight, self.rms_eps)
        if fused is None:
            return super().reduce_add_norm(partial, residual)
        normed, total = fused
        assert normed is not None
        return normed, total

    def reduce_add(self, partial: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        fused = self.comm.all_reduce_add(partial, residual, None, self.rms_eps)
        return super().reduce_add(partial, residual) if fused is None else fused[1]


class TPReferenceModel(ReferenceModel):
    """The reference model, one tensor-parallel rank of it (``group``: the tensor-parallel process group;
    ``None`` for one rank without torch.distributed).

    Everything a :class:`ReferenceModel` offers works unchanged: ``decode_step`` / ``prefill_step`` /
    ``verify_step`` (each rank gets the same batch and returns the full logits), the batch helpers, the
    runners (pass ``process_group=``; :func:`tp_decode_runner` does). ``config`` is the full model's;
    ``num_heads``, ``num_kv_heads``, ``intermediate_size`` and ``vocab_size`` must divide by the group's
    size. ``comm``: how collectives are issued (:mod:`devgraph.reference.tp.comm`; ``"symm"`` is collective
    at construction: every rank builds its model together). ``exact_weights``:
    draw the full weights on the CPU as ReferenceModel does (equal to it; slow for billions of
    parameters), else on ``device`` (fast, the same on every rank). ``fuse_all_reduce``: under ``symm``
    with the Triton kernels, each all-reduce and the residual add (and norm) after it run as one kernel
    (:meth:`~devgraph.reference.tp.comm.TPComm.all_reduce_add`); ``False`` keeps them apart.
    """

    def __init__(
        self,
        config: ReferenceConfig,
        group: Any = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        *,
        comm: str = "auto",
        exact_weights: bool = True,
        weights: str = "random",
        fuse_all_reduce: bool = True,
    ) -> None:
        nn.Module.__init__(self)  # ReferenceModel's own __init__ would draw and keep the full weights
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        # The largest all-reduce: a step of every request's every token ([tokens, hidden]); ``symm`` caps
        # its buffer (comm.SYMM_BUFFER_MAX_BYTES) and sends larger messages to NCCL.
        message = config.max_requests * config.max_seq_len * config.hidden_size
        self.comm = TPComm(
            group,
            comm,
            device,
            dtype=config.dtype,
            max_bytes=message * config.dtype.itemsize,
            fuse=fuse_all_reduce and fused_kernels(config.kernels, device),
            fuse_width=config.hidden_size,
        )
        size = self.comm.world_size
        bad = [
            f"{name}={getattr(config, name)}"
            for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size")
            if getattr(config, name) % size
        ]
        if bad:
            raise ConfigError(
                f"tensor parallelism over {size} ranks needs {', '.join(bad)} divisible by {size}; "
                "pick a tensor-parallel size that divides them"
            )
        if weights not in WEIGHT_INITS:
            raise ConfigError(f"weights={weights!r} is unknown; accepted: {', '.join(WEIGHT_INITS)}")
        set_up_triton(
            config.kernels,
            device,
            config.intermediate_size // size,
            config.dtype,
            bias=config.qkv_bias,
            decode=DecodeShapes.of(config, shards=size),
        )
        # "empty": shapes only, every weight filled later (a checkpoint loader slices each rank's part).
        draw = _drawer(seed, device, exact_weights) if weights == "random" else _empty(device)
        embed = draw((config.vocab_size, config.hidden_size), config.hidden_size)
        self.embed = nn.Parameter(embed.to(device=device, dtype=config.dtype), requires_grad=False)
        self.layers = nn.ModuleList(
            TPDecoderLayer(config, draw, self.comm, device) for _ in range(config.num_layers)
        )
        self.fused = fused_kernels(config.kernels, device)
        self.norm = RMSNorm(
            config.hidden_size, config.rms_eps, device=device, dtype=config.dtype, fused=self.fused
        )
        # An untied LM head is vocab-parallel too: this rank's rows, drawn last as ReferenceModel draws it.
        self.lm_head = None
        if not config.tie_embeddings:
            head = draw((config.vocab_size, config.hidden_size), config.hidden_size)
            part = _part(config.vocab_size, self.comm.rank, size)
            self.lm_head = nn.Parameter(
                head[part].contiguous().to(device=device, dtype=config.dtype), requires_grad=False
            )
        cos, sin = decoder_rope_tables(config, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def group(self) -> Any:
        """The tensor-parallel process group (``None`` for one rank)."""
        return self.comm.group

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel LM head: this rank's vocabulary slice, then an all-gather -> ``[T, vocab]``."""
        size = self.comm.world_size
        if self.lm_head is not None:  # already this rank's vocabulary slice
            local = linear(hidden, self.lm_head, None, self.fused)
        elif size == 1:
            return linear(hidden, self.embed, None, self.fused)
        else:
            part = self.config.vocab_size // size
            rows = self.embed[self.comm.rank * part : (self.comm.rank + 1) * part]
            local = linear(hidden, rows, None, self.fused)
        if size == 1:
            return local
        part = self.config.vocab_size // size
        # local: [T, vocab / size]
        gathered = self.comm.all_gather(local)  # [size * T, vocab / size], rank 0's rows first
        return gathered.view(size, -1, part).permute(1, 0, 2).reshape(-1, size * part)

    @torch.no_grad()
    def copy_cache_from(self, model: ReferenceModel) -> None:
        """Load this rank's KV heads of a single-device model's cache (to compare the two on one state)."""
        heads = self.config.num_kv_heads // self.comm.world_size
        start = self.comm.rank * heads
        for mine, full in zip((*self.k_cache, *self.v_cache), (*model.k_cache, *model.v_cache), strict=True):
            mine.copy_(full[:, :, start : start + heads].to(mine.device))
