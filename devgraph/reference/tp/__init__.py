"""The reference model sharded for tensor parallelism, and its runners.

Launch one process per GPU (``torchrun --nproc-per-node 2 ...``); on every rank::

    torch.distributed.init_process_group("nccl")
    model = TPReferenceModel(ReferenceConfig.preset("qwen3-0.6b"), group=torch.distributed.group.WORLD,
                             device=f"cuda:{local_rank}")
    runner = tp_decode_runner(model, mode="full")      # process_group=model.group
    runner.capture()                                   # every rank, same sizes, in step
    logits = runner.run(**batch)                       # every rank, the same batch, each step
    runner.close()                                     # before destroying the process group
    torch.distributed.destroy_process_group()

See docs/tensor-parallel.md.
"""

from typing import Any

from devgraph import GraphRunner
from devgraph.reference.runners import decode_runner, prefill_runner
from devgraph.reference.tp.comm import COMM_MODES, TPComm
from devgraph.reference.tp.model import TPDecoderLayer, TPReferenceModel

__all__ = [
    "COMM_MODES",
    "TPComm",
    "TPDecoderLayer",
    "TPReferenceModel",
    "tp_decode_runner",
    "tp_prefill_runner",
]


def tp_decode_runner(model: TPReferenceModel, **kwargs: Any) -> GraphRunner:
    """``decode_runner`` with ``process_group=model.group`` (capture handshake, lock-step check)."""
    kwargs.setdefault("process_group", model.group)
    return decode_runner(model, **kwargs)


def tp_prefill_runner(model: TPReferenceModel, **kwargs: Any) -> GraphRunner:
    """``prefill_runner`` with ``process_group=model.group``."""
    kwargs.setdefault("process_group", model.group)
    return prefill_runner(model, **kwargs)
