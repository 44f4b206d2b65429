"""What a runner needs from ``torch.distributed``: rank, barrier, the capture handshake, lock-step, teardown.

Tensor-parallel runners talk over two groups. The engine's process group (NCCL on GPUs) carries the
model's collectives, which live inside the graphs. A small gloo *control group* that devgraph builds once
per process group, over the same ranks, carries devgraph's own messages: the capture handshake
(:class:`CaptureSync`), the per-step key check (:func:`assert_same_key`) and the data-parallel key
agreement (:func:`agree_counts`) where the group is not NCCL's (on NCCL it runs on the device, on a
communicator of its own: :mod:`devgraph.ranks.transport`). gloo raises on a timeout or a
dead peer, where a collective stuck on a device is only ended by NCCL's watchdog killing the process. The
timeout is :func:`rank_timeout_s` (``DEVGRAPH_RANK_TIMEOUT_S``, default 60 s). Teardown keeps graphs
released before their communicator is destroyed (:mod:`devgraph.ranks.teardown`). See
docs/tensor-parallel.md.
"""

from devgraph.ranks.dp import GroupAgreement, GroupCounts, agree_counts, keys_code, variant_code
from devgraph.ranks.group import (
    DEFAULT_RANK_TIMEOUT_S,
    RANK_TIMEOUT_ENV,
    PeerLost,
    barrier,
    control_group,
    exchange,
    group_alive,
    group_ranks,
    is_multi_rank,
    rank_name,
    rank_of,
    rank_timeout_s,
    settle_device,
)
from devgraph.ranks.handshake import CaptureSync
from devgraph.ranks.lockstep import assert_same_key
from devgraph.ranks.teardown import (
    close_runners,
    destroy_process_group,
    install_destroy_guard,
    release_backend,
    track_runner,
)
from devgraph.ranks.transport import AGREEMENT_ENV, transport_name

__all__ = [
    "AGREEMENT_ENV",
    "CaptureSync",
    "DEFAULT_RANK_TIMEOUT_S",
    "GroupAgreement",
    "GroupCounts",
    "PeerLost",
    "RANK_TIMEOUT_ENV",
    "agree_counts",
    "assert_same_key",
    "barrier",
    "close_runners",
    "control_group",
    "destroy_process_group",
    "exchange",
    "group_alive",
    "group_ranks",
    "install_destroy_guard",
    "is_multi_rank",
    "keys_code",
    "rank_name",
    "rank_of",
    "rank_timeout_s",
    "release_backend",
    "settle_device",
    "track_runner",
    "transport_name",
    "variant_code",
]
