"""The reference serving engine in-process: allocator, scheduler, chunked prefill, preemption, sampling,
graphs vs eager. CPU, tiny preset, real runners (the CPU simulated graph under ``auto``)."""

from __future__ import annotations

import logging
import random
import threading

import pytest
import torch

from devgraph.errors import ConfigError, InputError
from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import (
    BlockAllocator,
    BlockTables,
    Engine,
    EngineConfig,
    EngineLoop,
    FinishReason,
    OutOfBlocks,
    RequestOutput,
    Sampler,
    SamplingParams,
    Schedule,
    Status,
)
from devgraph.serve.engine.request import Request

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)


@pytest.fixture(scope="module")
def small_cache_model() -> ReferenceModel:
    # 9 blocks of 16 slots, 8 usable: two 60-token requests cannot both hold their blocks.
    return ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4, num_blocks=9), seed=0)


def _prompts(count: int, seed: int, low: int = 3, high: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _engine(model: ReferenceModel, mode: str = "disabled", capture: bool = True, **config: object) -> Engine:
    settings: dict[str, object] = {"max_running_requests": 4, "token_budget": 32, **config}
    return Engine(model, EngineConfig(**settings), device_graph_mode=mode, progress=False, capture=capture)  # type: ignore[arg-type]


# -- allocator and tables ------------------------------------------------------------------------------
def test_allocator_never_hands_out_block_zero_and_catches_double_free() -> None:
    allocator = BlockAllocator(6)
    assert allocator.capacity == allocator.num_free == 5
    blocks = allocator.allocate(5)
    assert sorted(blocks) == [1, 2, 3, 4, 5]
    with pytest.raises(OutOfBlocks):
        allocator.allocate(1)
    allocator.free(blocks[:2])
    assert allocator.num_free == 2
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.free(blocks[:1])
    with pytest.raises(ConfigError):
        BlockAllocator(1)


def test_block_tables_gather_rows_and_keep_a_zero_padding_row() -> None:
    tables = BlockTables(max_rows=2, width=4)
    a, b = tables.acquire(), tables.acquire()
    tables.write(a, 0, [7, 8])
    tables.write(b, 0, [3])
    tables.write(a, 2, [9])
    got = tables.gather([b, a, tables.padding_row])
    assert got.tolist() == [[3, 0, 0, 0], [7, 8, 9, 0], [0, 0, 0, 0]]
    with pytest.raises(RuntimeError):
        tables.acquire()
    tables.release(a)
    assert tables.gather([tables.acquire()]).tolist() == [[0, 0, 0, 0]]


def _apply(device: torch.Tensor, changes: dict[str, object]) -> None:
    """What DeviceStep does with a step's table changes, on a plain tensor."""
    if "table_all" in changes:
        device.copy_(changes["table_all"])  # type: ignore[arg-type]
    if "table_clear" in changes:
        device.index_fill_(0, torch.tensor(changes["table_clear"], dtype=torch.int64), 0)  # type: ignore[arg-type]
    if "table_at" in changes:
        at = torch.tensor(changes["table_at"], dtype=torch.int64)  # type: ignore[arg-type]
        device.view(-1).index_copy_(0, at, torch.tensor(changes["table_values"], dtype=torch.int32))  # type: ignore[arg-type]


def test_block_table_changes_bring_a_copy_to_the_table_whatever_the_order() -> None:
    rng = random.Random(5)
    tables = BlockTables(max_rows=6, width=8)
    device = torch.zeros_like(tables.table)
    held: dict[int, int] = {}  # row -> blocks written
    for step in range(400):
        for _ in range(rng.randint(0, 4)):  # a step's writes, releases and new rows, in any order
            action = rng.random()
            if action < 0.3 and len(held) < 6:
                row = tables.acquire()
                count = rng.randint(1, 8)
                tables.write(row, 0, [rng.randrange(1, 99) for _ in range(count)])
                held[row] = count
            elif action < 0.55 and held:
                row = rng.choice(list(held))
                tables.release(row)
                del held[row]
            elif held:
                row = rng.choice(list(held))
                if held[row] < 8:
                    tables.write(row, held[row], [rng.randrange(1, 99)])
                    held[row] += 1
        if step % 97 == 96:
            tables.resync()  # a failed step: the next changes are the whole table
        changes = tables.changes()
        if step % 97 == 96:
            assert set(changes) == {"table_all"}
        _apply(device, changes)
        assert torch.equal(device, tables.table), step
    assert tables.changes() == {}


def test_block_table_changes_come_in_power_of_two_lengths() -> None:
    tables = BlockTables(max_rows=4, width=8)
    rows = [tables.acquire() for _ in range(3)]
    tables.write(rows[0], 0, [1, 2, 3])
    tables.write(rows[1], 0, [4, 5])
    changes = tables.changes()
    assert len(changes["table_at"]) == len(changes["table_values"]) == 8  # 5 entries, the last repeated
    assert list(changes["table_at"])[4:] == [list(changes["table_at"])[4]] * 4  # type: ignore[call-overload]
    device = torch.zeros_like(tables.table)
    _apply(device, changes)
    assert torch.equal(device, tables.table)
    for row in rows:
        tables.release(row)
    assert len(tables.changes()["table_clear"]) == 4  # type: ignore[arg-type]


def test_a_row_given_back_and_taken_again_in_one_step_is_cleared_then_written() -> None:
    tables = BlockTables(max_rows=1, width=4)
    row = tables.acquire()
    tables.write(row, 0, [5, 6, 7])
    device = torch.zeros_like(tables.table)
    _apply(device, tables.changes())
    tables.release(row)
    again = tables.acquire()
    tables.write(again, 0, [9])
    changes = tables.changes()
    assert list(changes["table_clear"]) == [row] and list(changes["table_values"]) == [9]  # type: ignore[call-overload]
    _apply(device, changes)
    assert device[row].tolist() == [9, 0, 0, 0]


def test_the_devices_block_tables_equal_the_hosts_after_every_step(small_cache_model: ReferenceModel) -> None:
    """Requests starting, finishing, preempted (a cache of 8 blocks), forking copies (copy-on-write), and a
    step that fails half-way (its changes may never reach the device: the next step sends the whole
    table): after every forward the device's copy equals the host's."""
    engine = _engine(small_cache_model, "full", scheduler="overlap")
    launch = engine.launch
    checked: list[int] = []
    differ: list[int] = []
    carrying: list[int] = []  # forwards that carry table changes
    fail_at = {2, 5, 9, 14}

    def checking(kind, message, arrays, context):  # type: ignore[no-untyped-def]
        if any(name in arrays for name in ("table_clear", "table_at")):
            carrying.append(len(checked))
            if len(carrying) in fail_at:  # a step whose table changes are then lost on the way
                checked.append(-1)
                raise RuntimeError("a forward that fails (injected)")
        result = launch(kind, message, arrays, context)
        # Recorded, not asserted here: the engine turns an exception of a forward into failed requests.
        checked.append(len(context.seq_lens))
        if not torch.equal(engine.device_step.tables, engine.tables.table):
            differ.append(len(checked))
        return result

    engine.launch = checking  # type: ignore[method-assign]
    copied: list[int] = []
    copy_blocks = engine.device_step.copy_blocks

    def counting_copies(sources, targets):  # type: ignore[no-untyped-def]
        copied.append(len(sources))
        return copy_blocks(sources, targets)

    engine.device_step.copy_blocks = counting_copies  # type: ignore[method-assign]
    prompts = _prompts(10, seed=11, low=20, high=60)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=6 + 5 * (i % 4), n=2 if i % 3 == 0 else 1))
    finished = 0
    while engine.has_work:
        finished += sum(o.finished for o in engine.step())
    assert not differ, f"the device's tables differ after forwards {differ}"
    assert checked.count(-1) == len(fail_at) and len(checked) > 30
    assert engine.scheduler.preemptions > 0 and copied  # the workload did preempt and copy on write
    engine.close()


# -- scheduling ----------------------------------------------------------------------------------------
def test_chunked_prefill_under_the_token_budget_then_decode(model: ReferenceModel) -> None:
    engine = _engine(model, scheduler="serial")
    request = engine.add_request(list(range(1, 71)), SamplingParams(max_tokens=3))
    lengths = []
    schedule = engine.scheduler.schedule

    def recorded() -> Schedule:
        planned = schedule()
        lengths.append([(c.start, c.length, c.samples) for c in planned.chunks])
        return planned

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    for _ in range(3):
        engine.step()
    assert lengths == [[(0, 32, False)], [(32, 32, False)], [(64, 6, True)]]
    assert len(request.output) == 1 and request.num_computed == 70
    assert schedule().decodes == [request]
    engine.close()


def test_continuous_batching_admits_fcfs_up_to_max_running(model: ReferenceModel) -> None:
    engine = _engine(model, max_running_requests=2, token_budget=64)
    first = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=n)) for n in (2, 6, 4)]
    engine.step()
    assert [r.status for r in first] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    # A request that arrives while others decode joins as soon as a slot frees, behind the earlier one.
    late = engine.add_request([4, 5], SamplingParams(max_tokens=2))
    order = []
    while engine.has_work:
        for output in engine.step():
            if output.finished:
                order.append(output.request_id)
    assert order[:2] == [first[0].request_id, first[1].request_id]
    assert set(order) == {r.request_id for r in (*first, late)}
    assert engine.stats()["steps"].get("mixed", 0) > 0  # decodes rode in prefill steps
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


def test_preemption_recomputes_the_newest_request_and_frees_every_block(
    small_cache_model: ReferenceModel,
) -> None:
    prompts = _prompts(3, seed=3, low=40, high=48)
    params = SamplingParams(max_tokens=20)
    alone = _engine(small_cache_model, deterministic=True)
    expected = [alone.generate([p], params)[0] for p in prompts]
    alone.close()
    engine = _engine(small_cache_model, deterministic=True)
    got = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert got == expected  # recomputation continues where the request was
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 8
    engine.close()


def test_a_request_larger_than_the_cache_or_context_is_refused(small_cache_model: ReferenceModel) -> None:
    engine = _engine(small_cache_model)
    with pytest.raises(InputError, match="KV blocks"):
        engine.add_request(list(range(100)), SamplingParams(max_tokens=100))
    with pytest.raises(InputError, match="context"):
        engine.add_request(list(range(250)), SamplingParams(max_tokens=10))
    with pytest.raises(InputError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InputError, match="token ids"):
        engine.add_request([1, 512], SamplingParams())
    with pytest.raises(InputError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ConfigError, match="token_budget"):
        EngineConfig(max_running_requests=8, token_budget=4)
    engine.close()


def test_warm_up_on_a_cache_too_small_for_it_names_the_flag_to_raise() -> None:
    tiny_cache = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4, num_blocks=4), seed=0)
    engine = _engine(tiny_cache)
    with pytest.raises(
        ConfigError, match=r"too small for the start-up warm-up.*--num-blocks\) to at least 8"
    ):
        engine.warm_up()
    engine.close()


@pytest.mark.parametrize("max_seq_len", [2, 3])
def test_the_warm_up_fits_the_smallest_context(max_seq_len: int) -> None:
    # `devgraph serve --max-seq-len 2` used to fail on the warm-up's own request (1 + 2 tokens).
    short = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4, max_seq_len=max_seq_len), seed=0)
    engine = _engine(short)
    engine.warm_up()
    assert engine.allocator.num_free == engine.allocator.capacity
    outputs = engine.generate([[5]], SamplingParams(max_tokens=max_seq_len - 1))
    assert len(outputs[0]) == max_seq_len - 1
    engine.close()


def test_flag_sizes_past_the_engine_limits_are_capped_with_a_warning(
    model: ReferenceModel, caplog: pytest.LogCaptureFixture
) -> None:
    flag = '{"decode": {"max_size": 4096}, "prefill": {"sizes": [16, 64, 4096]}}'
    with caplog.at_level(logging.WARNING, logger="devgraph.serve.engine"):
        engine = _engine(model, flag, capture=False)
    assert engine.decode_runner.sizes[-1] == 4  # max_running_requests
    assert engine.prefill_runner.sizes == (16, 32)  # token_budget
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("decode graphs are capped at 4" in w and "4096" in w for w in warnings)
    assert any("prefill graphs are capped at 32" in w for w in warnings)
    engine.close()


def test_stop_token_and_abort_free_blocks(model: ReferenceModel) -> None:
    engine = _engine(model)
    prompt = [5, 6, 7, 8]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    stop_at = next(i for i, t in enumerate(greedy) if t not in greedy[:i])
    request = engine.add_request(prompt, SamplingParams(max_tokens=6, stop_token_ids=(greedy[stop_at],)))
    while request.status is not Status.FINISHED:
        engine.step()
    assert request.output == greedy[:stop_at] and request.finish_reason is FinishReason.STOP
    running = engine.add_request(prompt, SamplingParams(max_tokens=50))
    waiting = [engine.add_request(prompt, SamplingParams(max_tokens=50)) for _ in range(5)]
    engine.step()
    assert running.blocks and waiting[-1].status is Status.WAITING
    for r in (running, waiting[-1]):
        output = engine.abort(r.request_id)
        assert output is not None and output.finish_reason is FinishReason.ABORT and r.blocks == []
    assert engine.abort(running.request_id) is None
    while engine.has_work:
        engine.step()
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


# -- determinism: graphs vs eager, batch composition ---------------------------------------------------
@pytest.mark.parametrize(
    "mode",
    ["auto", '{"decode": {"backend": "full", "lazy": true}, "prefill": {"backend": "full", "lazy": true}}'],
    ids=["auto", "lazy"],
)
def test_graphs_give_the_same_tokens_as_disabled_on_the_same_schedule(
    model: ReferenceModel, mode: str
) -> None:
    """Lazily: each key is captured on the first step that needs it, which resets the static buffers the
    step's ids and block tables would be written into (the engine then passes them as its own tensors)."""
    prompts = _prompts(6, seed=1)
    params = [SamplingParams(max_tokens=n) for n in (1, 4, 9, 12, 3, 7)]
    eager = _engine(model, "disabled")
    graphs = _engine(model, mode)
    assert eager.generate(prompts, params) == graphs.generate(prompts, params)
    stats = graphs.stats()["runners"]
    assert stats["decode"]["replays"] > 0 and stats["prefill"]["replays"] > 0
    assert eager.stats()["runners"]["decode"]["eager_by_reason"]["disabled"] > 0
    eager.close()
    graphs.close()


@pytest.mark.parametrize("mode", ["disabled", "auto"])
def test_a_prompt_scored_in_a_step_that_carries_decodes_finishes_with_its_neighbours(
    model: ReferenceModel, mode: str
) -> None:
    """A mixed step (a prompt chunk with decodes riding along) runs on the prefill runner: its second output
    is the hidden states the prompt's log probabilities come from, not the decode graph's greedy tokens."""
    engine = _engine(model, mode, max_running_requests=8)
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=4, prompt_logprobs=1)]
    outputs = engine.generate([[1, 2, 3, 4, 5], list(range(10, 50))], params)  # 40 tokens: two chunks
    assert engine.stats()["steps"].get("mixed", 0) > 0
    assert [len(tokens) for tokens in outputs] == [6, 4]
    assert dict(engine.finished_count) == {"length": 2}
    engine.close()


def test_deterministic_mode_tokens_do_not_depend_on_the_batch(model: ReferenceModel) -> None:
    prompts = _prompts(5, seed=2)
    params = [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11),
        SamplingParams(max_tokens=5, temperature=1.3, seed=12),
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=6, temperature=0.7, seed=13),
    ]
    engine = _engine(model, "auto", deterministic=True)
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert batched == alone
    assert set(engine.decode_runner.stats()["replays_by_key"]) == {"tokens=4,requests=4"}
    assert engine.stats()["engine_padding_tokens"] > 0
    engine.close()


# -- sampling ------------------------------------------------------------------------------------------
def _request(params: SamplingParams) -> Request:
    return Request("r", [1], params, 0)


def test_sampler_is_greedy_at_temperature_zero_and_seeded_otherwise() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    greedy = sampler.sample(logits, [_request(SamplingParams())] * 3)
    assert greedy == logits.argmax(-1).tolist()
    draws = [
        [sampler.sample(logits[:1], [r])[0] for _ in range(20)]
        for r in (_request(SamplingParams(temperature=1.0, seed=7)) for _ in range(2))
    ]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1
    other = _request(SamplingParams(temperature=1.0, seed=8))
    assert [sampler.sample(logits[:1], [other])[0] for _ in range(20)] != draws[0]
    # A tiny top_p keeps only the most likely token.
    narrow = _request(SamplingParams(temperature=1.0, top_p=1e-4, seed=1))
    assert {sampler.sample(logits[1:2], [narrow])[0] for _ in range(10)} == {greedy[1]}


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    sampler = Sampler()
    request = _request(SamplingParams(temperature=1.0, top_p=0.7, seed=3))
    seen = {sampler.sample(probs.log(), [request])[0] for _ in range(200)}
    assert seen == {1, 3}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 0 are cut


def _forced(**fields: object) -> Request:
    """A sampling request whose parameters skip validation (what the sampler must survive anyway)."""
    params = SamplingParams(temperature=1.0, seed=1)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return _request(params)


def test_a_row_that_cannot_be_sampled_falls_back_to_greedy_alone() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[4, 3] = float("nan")
    greedy = logits.argmax(-1).tolist()
    requests = [
        _request(SamplingParams()),
        _forced(temperature=1e-40),  # logits / 1e-40 overflow: softmax is NaN
        _forced(top_p=1e-50),  # 0.0 in float32: nothing would be kept
        _request(SamplingParams(temperature=1.0, seed=3)),
        _forced(),  # NaN logits
    ]
    alone = Sampler().sample(logits[3:4], [_request(SamplingParams(temperature=1.0, seed=3))])[0]
    tokens = Sampler().sample(logits, requests)
    assert tokens[:3] == greedy[:3] and tokens[4] == greedy[4]
    assert tokens[3] == alone  # the healthy sampled row is untouched by its neighbours


def test_sampling_parameters_that_float32_cannot_honour_are_refused() -> None:
    for fields, needle in (
        ({"temperature": 1e-40}, "temperature must be 0 \\(greedy\\) or a number from 0.0001"),
        ({"top_p": 1e-50}, "top_p must be a number from 0.0001"),
        ({"seed": -1}, "seed must be an int >= 0"),
        ({"stop_token_ids": tuple(range(65))}, "at most 64 stop token ids"),
    ):
        with pytest.raises(InputError, match=needle):
            SamplingParams(**fields)  # type: ignore[arg-type]
    request = _request(SamplingParams(stop_token_ids=(5, 6, 5)))
    assert request.stop_ids == frozenset({5, 6})


def test_identical_seeds_give_identical_text_across_batches(model: ReferenceModel) -> None:
    engine = _engine(model, deterministic=True)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42)
    prompt = [9, 8, 7, 6]
    alone = engine.generate([prompt], params)[0]
    crowded = engine.generate([prompt, *_prompts(3, seed=5)], [params] + [SamplingParams(max_tokens=10)] * 3)
    assert crowded[0] == alone
    assert engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=43))[0] != alone
    engine.close()


# -- the engine thread ---------------------------------------------------------------------------------
def test_engine_loop_serves_other_threads_and_aborts_on_shutdown(model: ReferenceModel) -> None:
    engine = _engine(model)
    loop = EngineLoop(engine)
    loop.start()
    outputs: dict[str, list[RequestOutput]] = {}
    done = threading.Event()

    def sink(output: RequestOutput) -> None:
        outputs.setdefault(output.request_id, []).append(output)
        if output.finished and output.finish_reason is FinishReason.LENGTH:
            done.set()

    short = loop.submit([1, 2, 3], SamplingParams(max_tokens=3), sink)
    long = loop.submit([4, 5, 6], SamplingParams(max_tokens=200), sink)
    assert done.wait(30)
    assert [len(o.token_ids) for o in outputs[short]] == [1, 1, 1]
    with pytest.raises(InputError):
        loop.submit([], SamplingParams(), sink)
    loop.shutdown(drain_seconds=0.0)
    assert outputs[long][-1].finish_reason is FinishReason.ABORT
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


def test_a_failing_forward_fails_its_requests_and_the_engine_goes_on(
    model: ReferenceModel, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(model, mixed_steps=False)
    decoding = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    engine.step()  # prefill: `decoding` now decodes
    fresh = engine.add_request([4, 5, 6], SamplingParams(max_tokens=5))
    real_run = engine.prefill_runner.run

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("device fell over")

    engine.prefill_runner.run = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="devgraph.serve.engine"):
        outputs = {o.request_id: o for o in engine.step()}
    assert any(
        "prefill step failed" in r.getMessage() and "device fell over" in r.getMessage()
        for r in caplog.records
    )
    assert outputs[fresh.request_id].finish_reason is FinishReason.ERROR
    assert "device fell over" in (outputs[fresh.request_id].error or "")
    assert outputs[decoding.request_id].token_ids and not outputs[decoding.request_id].finished
    engine.prefill_runner.run = real_run  # type: ignore[method-assign]
    assert engine.generate([[7, 8]], SamplingParams(max_tokens=2))[0]
    while engine.has_work:
        engine.step()
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()
