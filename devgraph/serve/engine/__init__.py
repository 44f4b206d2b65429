"""The reference serving engine: paged KV blocks, continuous batching, chunked prefill, sampling.

A harness and a showcase for devgraph (not a production server): requests join and leave at every step,
batches change composition, prefill chunks mix with decodes, and every forward goes through a
``GraphRunner`` built from the ``--device-graph-mode`` flag::

    model = ReferenceModel(ReferenceConfig.preset("tiny"), seed=0)
    engine = Engine(model, EngineConfig(max_running_requests=8, token_budget=64), device_graph_mode="auto")
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))

``devgraph serve`` puts it behind an HTTP API (see docs/serving.md).
"""

from devgraph.serve.engine.allocator import BlockAllocator, BlockTables, OutOfBlocks
from devgraph.serve.engine.config import EngineConfig, OutputDelivery, SchedulerMode
from devgraph.serve.engine.engine import Engine
from devgraph.serve.engine.engine_thread import EngineAsleep, EngineClosed, EngineLoop, Sink
from devgraph.serve.engine.request import FinishReason, Request, RequestOutput, SamplingParams, Status
from devgraph.serve.engine.sampler import Sampler
from devgraph.serve.engine.scheduler import Chunk, Schedule, Scheduler

__all__ = [
    "BlockAllocator",
    "BlockTables",
    "Chunk",
    "Engine",
    "EngineAsleep",
    "EngineClosed",
    "EngineConfig",
    "OutputDelivery",
    "EngineLoop",
    "FinishReason",
    "OutOfBlocks",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Sampler",
    "Schedule",
    "Scheduler",
    "SchedulerMode",
    "Sink",
    "Status",
]
