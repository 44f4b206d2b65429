"""``devgraph serve --tp N``: the reference model sharded over N processes, one per device.

Rank 0 (the process the user started) runs HTTP, the scheduler and sampling; it spawns ranks 1..N-1
itself (:mod:`~devgraph.serve.tp.world`), and before every forward hands the step's batch to them through
a ring in shared memory (:mod:`~devgraph.serve.tp.channel`: the bytes of :mod:`~devgraph.serve.engine.wire` in
the slots of :mod:`~devgraph.serve.tp.ring`); every rank then runs the same forward (graph replay) on its
shard (:mod:`~devgraph.serve.tp.worker`). A rank that dies or stops answering ends the
server: in-flight requests get an error, the process exits 1. See docs/tensor-parallel.md.
"""

from devgraph.serve.tp.channel import RankLost, StepChannel, WorkerChannel
from devgraph.serve.tp.engine import TPEngine
from devgraph.serve.tp.world import TPWorld, start_world

__all__ = ["RankLost", "StepChannel", "TPEngine", "TPWorld", "WorkerChannel", "start_world"]
