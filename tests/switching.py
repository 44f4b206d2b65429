"""Serving across the switch from eager steps to graphs: the same prompts through an engine whose graphs
were captured up front and through one whose graphs are captured in the background after its first
``eager_steps`` steps (tests/test_background.py on the CPU, tests/test_cuda_background.py on a GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from devgraph.reference import ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams


def tokens_across_the_switch(
    model: ReferenceModel,
    config: EngineConfig,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    eager_steps: int,
) -> tuple[list[list[int]], list[Any], Engine]:
    """The up-front engine's tokens, the switching engine's (each request's output), and the switching
    engine itself, still open for its stats (the caller closes it)."""
    ahead = Engine(model, config, progress=False)
    expected = ahead.generate(prompts, params)
    ahead.close()
    engine = Engine(model, config, progress=False, capture=False)
    background = engine.capture_in_background()
    requests = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps >= eager_steps:  # the steps before this ran with no graph at all
            background.step()
    return expected, [r.output for r in requests], engine
