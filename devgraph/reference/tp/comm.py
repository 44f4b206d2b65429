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
"""

from __future__ import annotations

from typing import Any

import torch

from devgraph import ConfigError
from devgraph.platforms.sim.graph import record_opaque

__all__ = ["COMM_MODES", "TPComm"]

COMM_MODES: tuple[str, ...] = ("auto", "torch", "op")

# Process groups the custom ops may name (an op's schema takes the group's name, not the object).
_groups: dict[str, Any] = {}


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


class TPComm:
    """The collectives of one tensor-parallel rank over ``group`` (``None``: one rank, no collectives)."""

    def __init__(self, group: Any, comm: str = "auto", device: torch.device | None = None) -> None:
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
        device_type = device.type if device is not None else "cpu"
        self.mode = comm if comm != "auto" else ("op" if device_type == "cpu" else "torch")
        self.group_name = group.group_name if distributed else ""
        if distributed and self.mode == "op":
            _groups[self.group_name] = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return tensor
        if self.mode == "torch":
            torch.distributed.all_reduce(tensor, group=self.group)
        else:
            torch.ops.devgraph_tp.all_reduce(tensor, self.group_name)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[N, C]`` on each rank -> ``[world_size * N, C]``, rank 0's rows first."""
        if self.world_size == 1:
            return tensor
        if self.mode == "torch":
            return _all_gather_now(tensor, self.group, self.world_size)
        return torch.ops.devgraph_tp.all_gather(tensor, self.group_name, self.world_size)

    def __repr__(self) -> str:
        return f"TPComm(rank={self.rank}, world_size={self.world_size}, mode={self.mode!r})"
