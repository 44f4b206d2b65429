"""The engine's prompt log-probabilities and ``n`` copies sharing one prefill (CPU, tiny preset, real
runners: the CPU simulated graph under ``auto``): prompt scores equal a whole-prompt forward's
log-softmax through chunked prefill, with graphs and without, scored once across a preemption; copies
compute the prompt once, write into private copies of shared blocks, and sample what each copy would
alone; ``max_tokens=0`` scores the prompt and samples nothing."""

from __future__ import annotations

import pytest
import torch

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams, Status

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CONFIG = ReferenceConfig.preset("tiny", max_requests=4, dtype="float32")
PROMPT = [(i * 37 + 11) % 500 for i in range(70)]  # 70 tokens: 3 chunks of a 32-token budget, 5 blocks


def _engine(mode: str = "disabled", **config: object) -> Engine:
    settings: dict[str, object] = {"max_running_requests": 4, "token_budget": 32, **config}
    model = ReferenceModel(CONFIG, seed=0)
    return Engine(model, EngineConfig(**settings), device_graph_mode=mode, progress=False)  # type: ignore[arg-type]


def _whole_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    """log_softmax of every prompt row, from one eager forward of the whole prompt on a fresh model."""
    model = ReferenceModel(CONFIG, seed=0)
    block = CONFIG.block_size
    blocks = -(-len(prompt) // block)
    tables = torch.zeros((1, CONFIG.max_blocks_per_request), dtype=torch.int32)
    tables[0, :blocks] = torch.arange(1, blocks + 1, dtype=torch.int32)
    positions = torch.arange(len(prompt))
    with torch.no_grad():
        logits = model.verify_step(
            torch.tensor(prompt),
            positions,
            tables[0, positions // block].long() * block + positions % block,
            tables,
            torch.tensor([len(prompt)], dtype=torch.int32),
            torch.tensor([0, len(prompt)], dtype=torch.int32),
        )
    return logits.float().log_softmax(-1)


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    request = engine.add_request(prompt, params)
    outputs = []
    while engine.has_work:
        outputs += [o for o in engine.step() if o.group == request.request_id]
    return outputs


@pytest.mark.parametrize("mode", ["disabled", "auto"])
def test_prompt_logprobs_equal_a_whole_prompt_forward_through_chunked_prefill(mode: str) -> None:
    engine = _engine(mode)
    outputs = _run(engine, PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    scored = outputs[0].prompt_logprobs
    assert scored is not None and len(scored) == len(PROMPT) and scored[0] is None
    expected = _whole_prompt_logprobs(PROMPT)
    for position, entry in enumerate(scored[1:], start=1):
        row = expected[position - 1]
        assert entry.token == PROMPT[position]
        assert entry.logprob == pytest.approx(float(row[PROMPT[position]]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert entry.rank == int((row > row[PROMPT[position]]).sum()) + 1
    assert all(o.prompt_logprobs is None for o in outputs[1:])  # on the first output only
    if mode == "auto":
        assert engine.prefill_runner.stats()["replays"] > 0
    engine.close()


def test_max_tokens_zero_scores_the_prompt_and_samples_nothing() -> None:
    engine = _engine()
    (output,) = _run(engine, PROMPT[:20], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert output.finished and output.finish_reason.value == "length" and output.token_ids == []
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == 20
    assert engine.generation_tokens == 0
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


@pytest.mark.parametrize("length", [20, 70])
def test_max_tokens_zero_gives_every_copy_the_whole_prompts_scores(length: int) -> None:
    # echo with logprobs, n=2, max_tokens=0 (the server's 500): the last copy to finish closed the group
    # first and then looked its prompt's scores up in it, getting [None] instead of the first copy's.
    engine = _engine()
    outputs = _run(engine, PROMPT[:length], SamplingParams(max_tokens=0, prompt_logprobs=1, n=3))
    assert sorted(o.index for o in outputs) == [0, 1, 2] and all(o.finished for o in outputs)
    first = next(o for o in outputs if o.index == 0).prompt_logprobs
    assert first is not None and len(first) == length
    assert all(o.prompt_logprobs == first for o in outputs)
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


def test_prompt_logprobs_are_scored_once_when_a_preempted_request_recomputes() -> None:
    # 9 blocks of 16 slots (8 usable): two 60-token requests cannot both hold their blocks.
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4, num_blocks=9, dtype="float32"))
    engine = Engine(
        model, EngineConfig(max_running_requests=4, token_budget=32), device_graph_mode="disabled"
    )
    first = engine.add_request(PROMPT[:40], SamplingParams(max_tokens=60, temperature=0, prompt_logprobs=1))
    engine.add_request(PROMPT[30:70], SamplingParams(max_tokens=60, temperature=0))
    while engine.has_work:
        engine.step()
    assert engine.scheduler.preemptions > 0
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 40
    engine.close()


@pytest.mark.parametrize("mode", ["disabled", "auto"])
def test_n_copies_compute_the_prompt_once_and_each_samples_what_it_would_alone(mode: str) -> None:
    engine = _engine(mode)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=4)
    outputs = _run(engine, PROMPT, params)
    assert engine.prefill_tokens == len(PROMPT)  # one prefill for four copies, not four
    assert engine.allocator.num_free == engine.allocator.capacity  # shared and copied blocks all freed
    tokens = {i: [t for o in outputs if o.index == i for t in o.token_ids] for i in range(4)}
    assert sum(o.finished for o in outputs) == 4
    alone = _engine(mode)
    for i in range(4):  # copy i samples with seed + i, from its own (copied-on-write) cache
        single = _run(alone, PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i))
        assert tokens[i] == [t for o in single for t in o.token_ids], i
    assert len({tuple(t) for t in tokens.values()}) > 1  # different seeds, different samples
    assert alone.prefill_tokens == 4 * len(PROMPT)
    engine.close()
    alone.close()


def test_copy_on_write_copies_only_the_shared_partial_block(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine()
    prompt = PROMPT[:40]  # 2 whole blocks and 8 tokens of a third
    copied: list[tuple[int, int]] = []
    original = engine.device_step.copy_blocks

    def spy(sources: torch.Tensor, targets: torch.Tensor) -> None:
        copied.extend(zip(sources.tolist(), targets.tolist(), strict=True))
        original(sources, targets)

    monkeypatch.setattr(engine.device_step, "copy_blocks", spy)
    request = engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, n=3))
    while engine.has_work:
        engine.step()
        if request.status is Status.RUNNING and len(request.output) == 1:
            holders = [engine.allocator.holders(b) for b in request.blocks]
            assert holders[:2] == [3, 3]  # whole prompt blocks stay shared by the three copies
    assert len(copied) == 2  # the partial block: two of the three copies take a private copy
    engine.close()


def test_a_group_is_aborted_whole_or_one_copy_at_a_time() -> None:
    engine = _engine()
    request = engine.add_request(PROMPT[:10], SamplingParams(max_tokens=50, temperature=0, n=3))
    engine.step()
    (one,) = engine.abort_group(request.request_id, index=1)
    assert one.index == 1 and one.finished
    rest = engine.abort_group(request.request_id)
    assert sorted(o.index for o in rest) == [0, 2]
    assert engine.drain() == []  # the step in flight (overlapped) gives the aborted copies nothing
    assert not engine.has_work and engine.allocator.num_free == engine.allocator.capacity
    engine.close()


@pytest.mark.parametrize("scheduler", ["overlap", "serial"])
def test_groups_admitted_together_never_fork_past_the_running_limit(scheduler: str) -> None:
    # Two groups of 3 copies and a running limit of 4: each group fits alone, both together do not. Before,
    # the second group was admitted while the first's copies were still waiting for its prompt (they were
    # not counted), and the step that forked both failed: 'no block-table row free' (a 500 for every
    # request of a completions call with a list of prompts and n=3, or for concurrent n > 1 requests).
    engine = _engine(scheduler=scheduler)
    groups = [
        engine.add_request(PROMPT[i : i + 10], SamplingParams(max_tokens=4, temperature=0, n=3))
        for i in range(3)
    ]
    outputs = []
    while engine.has_work:
        outputs += engine.step()
        assert len(engine.scheduler.running) <= 4
    errors = [o for o in outputs if o.finish_reason is not None and o.finish_reason.value == "error"]
    assert errors == []
    for group in groups:
        mine = [o for o in outputs if o.group == group.request_id]
        assert sorted(o.index for o in mine if o.finished) == [0, 1, 2]
        for index in range(3):
            assert sum(len(o.token_ids) for o in mine if o.index == index) == 4
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()
