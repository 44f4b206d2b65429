"""An engine's counters as plain data: what ``/metrics``, ``/v1/engine/stats`` and the stats log line read."""

from __future__ import annotations

from typing import Any


def engine_stats(engine: Any) -> dict[str, Any]:  # an Engine (it imports this module)
    """Requests, KV blocks, token totals, step and finish counts, the config, both runners' stats, the
    background capture's progress and whether the engine sleeps."""
    return {
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "kv_blocks_free": engine.allocator.num_free,
        "kv_blocks_total": engine.allocator.capacity,
        "prompt_tokens": engine.prompt_tokens,
        "generation_tokens": engine.generation_tokens,
        "prefill_tokens": engine.prefill_tokens,
        "steps": dict(engine.step_counts),
        "preemptions": engine.scheduler.preemptions,
        "engine_padding_tokens": engine.engine_padding,
        "finished": dict(engine.finished_count),
        "config": {
            "max_running_requests": engine.config.max_running_requests,
            "token_budget": engine.config.token_budget,
            "mixed_steps": engine.config.mixed,
            "deterministic": engine.config.deterministic,
            "scheduler": str(engine.config.scheduler),
        },
        "serial_steps": dict(engine.serial_steps),
        "runners": {"decode": engine.decode_runner.stats(), "prefill": engine.prefill_runner.stats()},
        "graph_capture": None if engine.background is None else engine.background.progress(),
        "sleeping": engine.sleep_level is not None,
    }
