"""The overlapped scheduler: step N+1 is scheduled and issued before step N's tokens are read.

Every case here is one a naive overlap gets wrong: a request that stops at step N (stop token, stop string,
``max_tokens``, grammar completion, abort) must get nothing from step N+1, its KV blocks must stay its own
while a step that addresses them is issued, a request preempted while its last token is still on the
device must resume from that token, ``n > 1`` copies fork while the step runs, and the prompt's log
probabilities are scored once. Each compares the overlapped engine with the serial one (same tokens, same
streamed outputs) on the CPU (tiny preset, simulated graphs) and on a checkpoint against transformers;
``cuda`` cases check the same on a GPU and that issuing a step never blocks the host.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import (
    BlockAllocator,
    BlockTables,
    Engine,
    EngineConfig,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    Status,
)
from devgraph.serve.engine.engine import IssuedForward

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

SCHEDULERS = ("serial", "overlap")


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), seed=0)


@pytest.fixture(scope="module")
def small_cache_model() -> ReferenceModel:
    # 9 blocks of 16 slots, 8 usable: three 40-token prompts growing to 60 cannot all hold their blocks.
    return ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4, num_blocks=9), seed=0)


def _engine(model: ReferenceModel, scheduler: str, mode: str = "auto", **config: Any) -> Engine:
    settings: dict[str, Any] = {"max_running_requests": 4, "token_budget": 32, "scheduler": scheduler}
    return Engine(model, EngineConfig(**{**settings, **config}), device_graph_mode=mode, progress=False)


def _prompts(count: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(low, high))] for _ in range(count)]


class Tap:
    """Records what the engine issues and reads: the requests each forward samples, and the tokens read
    for requests that had finished by then (dropped)."""

    def __init__(self, engine: Engine) -> None:
        self.sampled: list[list[str]] = []
        self.dropped: list[str] = []
        issue, read = engine._issue_forward, engine._read_forward

        def issued(forward: IssuedForward, *args: Any) -> None:
            issue(forward, *args)
            self.sampled.append([m.request_id for m in forward.sampled])

        def reading(forward: IssuedForward) -> list[RequestOutput]:
            self.dropped += [m.request_id for m in forward.sampled if m.status is Status.FINISHED]
            return read(forward)

        engine._issue_forward = issued  # type: ignore[method-assign]
        engine._read_forward = reading  # type: ignore[method-assign]

    def steps_of(self, request_id: str) -> int:
        return sum(ids.count(request_id) for ids in self.sampled)


def _serve(
    engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> tuple[list[Request], dict[str, list[RequestOutput]]]:
    """Add every prompt, step until the engine has nothing left (the step in flight read too); the
    requests and every output each got, in order."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    streams: dict[str, list[RequestOutput]] = {}
    while engine.has_work:
        for output in engine.step():
            streams.setdefault(output.request_id, []).append(output)
    return requests, streams


def _stream(outputs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    """What a client sees of a request's outputs (timings left out)."""
    return [
        (o.token_ids, o.finished, o.finish_reason, o.logprobs, o.prompt_logprobs, o.index) for o in outputs
    ]


def _check_streams(requests: list[Request], streams: dict[str, list[RequestOutput]]) -> None:
    """Each request: its streamed tokens are its output, exactly one output finishes it, and it is last."""
    for request in requests:
        outputs = streams[request.request_id]
        assert [t for o in outputs for t in o.token_ids] == request.output, request.request_id
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True], request.request_id


# -- the same tokens as the serial scheduler --------------------------------------------------------------
def test_overlapped_outputs_equal_the_serial_schedulers(model: ReferenceModel) -> None:
    prompts = _prompts(8, seed=1)
    greedy = _engine(model, "serial", deterministic=True)
    probe = greedy.generate([prompts[2]], SamplingParams(max_tokens=10))[0]
    greedy.close()
    stop = next(t for i, t in enumerate(probe) if i >= 3 and t not in probe[:i])
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=40, seed=3),
        SamplingParams(max_tokens=10, stop_token_ids=(stop,)),  # stops mid-way
        SamplingParams(max_tokens=6, logprobs=2),
        SamplingParams(max_tokens=5, temperature=1.0, seed=4, n=2),  # copies fork while steps run
        SamplingParams(max_tokens=0, prompt_logprobs=2),  # the prompt alone
        SamplingParams(max_tokens=4, prompt_logprobs=1, logprobs=1),
        SamplingParams(max_tokens=1),
    ]
    got = {}
    for scheduler in SCHEDULERS:
        engine = _engine(model, scheduler, deterministic=True)
        requests, streams = _serve(engine, prompts, params)
        got[scheduler] = {rid: _stream(streams[rid]) for rid in sorted(streams)}
        assert requests[2].finish_reason is FinishReason.STOP and stop not in requests[2].output
        assert engine.allocator.num_free == engine.allocator.capacity
        streamed = sum(len(o.token_ids) for outputs in streams.values() for o in outputs)
        assert engine.stats()["generation_tokens"] == streamed  # no dropped token counted
        engine.close()
    assert got["overlap"] == got["serial"]


@pytest.mark.parametrize("mode", ["auto", "disabled"])
def test_one_request_at_a_time_gives_the_serial_tokens_in_default_mode(
    model: ReferenceModel, mode: str
) -> None:
    # Alone, a request's steps have the same shapes under both schedulers: its tokens are equal even
    # without --deterministic (batched, the overlapped scheduler admits a step later: other shapes).
    prompts = _prompts(3, seed=7)
    params = SamplingParams(max_tokens=14, temperature=0.7, seed=9)
    outputs = {}
    for scheduler in SCHEDULERS:
        engine = _engine(model, scheduler, mode)
        outputs[scheduler] = [engine.generate([p], params)[0] for p in prompts]
        engine.close()
    assert outputs["overlap"] == outputs["serial"]


# -- a request that stops at step N gets nothing from step N+1 -------------------------------------------
def test_a_stop_token_at_step_n_drops_the_token_step_n_plus_1_sampled(model: ReferenceModel) -> None:
    prompt = [5, 6, 7, 8]
    engine = _engine(model, "overlap")
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    stop_at = next(i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    tap = Tap(engine)
    before = engine.stats()["generation_tokens"]
    (request,), streams = _serve(
        engine, [prompt], [SamplingParams(max_tokens=12, stop_token_ids=(greedy[stop_at],))]
    )
    assert request.output == greedy[:stop_at] and request.finish_reason is FinishReason.STOP
    # The step after the stop token's was issued before the stop was read: its token was dropped.
    assert tap.steps_of(request.request_id) == stop_at + 2
    assert tap.dropped == [request.request_id]
    _check_streams([request], streams)
    assert streams[request.request_id][-1].token_ids == []  # the stop token is not output
    assert engine.stats()["generation_tokens"] - before == stop_at  # the dropped token is not counted
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


def test_max_tokens_is_known_on_the_host_so_no_step_is_wasted(model: ReferenceModel) -> None:
    engine = _engine(model, "overlap")
    tap = Tap(engine)
    requests, streams = _serve(engine, _prompts(3, seed=2), [SamplingParams(max_tokens=n) for n in (1, 5, 9)])
    assert [len(r.output) for r in requests] == [1, 5, 9]
    assert [tap.steps_of(r.request_id) for r in requests] == [1, 5, 9]  # not one more each
    assert tap.dropped == []
    _check_streams(requests, streams)
    engine.close()


@pytest.mark.parametrize("reason", [FinishReason.ABORT, FinishReason.STOP])
def test_an_abort_or_a_stop_string_mid_overlap_gets_no_later_token(
    model: ReferenceModel, reason: FinishReason
) -> None:
    # The HTTP handler ends a request whose text reached a stop string with abort(id, STOP) between two
    # steps, when the next step (with the request in it) is already on the device.
    engine = _engine(model, "overlap")
    tap = Tap(engine)
    request = engine.add_request([9, 8, 7], SamplingParams(max_tokens=40))
    other = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=12))
    streamed: list[int] = []
    while len(request.output) < 4:
        streamed += [t for o in engine.step() if o.request_id == request.request_id for t in o.token_ids]
    assert request.pending == 1  # its next token is on the device
    ended = engine.abort(request.request_id, reason)
    assert ended is not None and ended.finish_reason is reason and ended.token_ids == []
    assert request.blocks == []
    later: list[RequestOutput] = []
    while engine.has_work:
        later += [o for o in engine.step() if o.request_id == request.request_id]
    assert later == [] and request.output == streamed
    assert request.request_id in tap.dropped
    assert len(other.output) == 12
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


class _Rising:
    """A toy grammar: every token larger than the one before, complete after ``length`` tokens. Its mask
    depends on the last token taken, so a mask computed before that token is read lets bad tokens in."""

    def __init__(self, length: int) -> None:
        self.length = length

    def start(self) -> _RisingState:
        return _RisingState(self.length)


class _RisingMasker:
    def mask(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[Any]) -> torch.Tensor:
        logits = logits.clone()
        for row, state in zip(rows, states, strict=True):
            logits[row, : state.last + 1] = float("-inf")
        return logits


_MASKER = _RisingMasker()


class _RisingState:
    def __init__(self, length: int) -> None:
        self.length, self.last, self.taken = length, -1, 0

    @property
    def masker(self) -> _RisingMasker:
        return _MASKER

    def advance(self, token: int) -> bool:
        assert token > self.last, f"token {token} after {self.last}: the mask was computed too early"
        self.last, self.taken = token, self.taken + 1
        return self.taken == self.length


def test_a_request_with_a_grammar_runs_its_steps_serially(model: ReferenceModel) -> None:
    prompts = _prompts(3, seed=4)
    params = [
        SamplingParams(max_tokens=20, grammar=_Rising(5)),
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=20, temperature=1.0, seed=2, grammar=_Rising(4)),
    ]
    got = {}
    for scheduler in SCHEDULERS:
        engine = _engine(model, scheduler, deterministic=True)
        requests, streams = _serve(engine, prompts, params)
        got[scheduler] = {rid: _stream(s) for rid, s in streams.items()}
        assert [len(r.output) for r in requests] == [5, 8, 4]
        assert requests[0].finish_reason is requests[2].finish_reason is FinishReason.STOP
        for constrained in (requests[0], requests[2]):
            assert constrained.output == sorted(set(constrained.output))  # rising, as the grammar says
        if scheduler == "overlap":
            assert engine.stats()["serial_steps"]["constrained"] > 0
        engine.close()
    assert got["overlap"] == got["serial"]


# -- KV blocks, preemption, copies ----------------------------------------------------------------------
def test_every_block_a_forward_addresses_is_held_when_it_is_issued(small_cache_model: ReferenceModel) -> None:
    # The device runs the engine's work in issue order, so a block freed on the host after a step was
    # issued is only written by later work. What the host must never do is issue a forward that addresses
    # a block nobody holds (freed when a finish or a preemption was read, before the forward went out).
    engine = _engine(small_cache_model, "overlap")
    block_size = small_cache_model.config.block_size
    checked: list[int] = []
    launch = engine.launch

    problems: list[str] = []  # recorded, not raised: the engine turns a forward's exception into errors

    def checking(kind: str, message: Any, arrays: dict[str, torch.Tensor], context: Any) -> Any:
        lengths = context.seq_lens
        result = launch(kind, message, arrays, context)  # the CPU runs it now
        tables = engine.device_step.tables.index_select(0, arrays["table_rows"])[: len(lengths)]
        for table, length in zip(tables.tolist(), lengths, strict=True):
            for block in table[: -(-length // block_size)]:
                if engine.allocator.holders(block) == 0:
                    problems.append(f"{kind} step addresses free block {block}")
        written = {s // block_size for s in arrays["slot_mapping"].tolist()} - {0}  # 0: padding's scratch
        if not all(engine.allocator.holders(b) > 0 for b in written):
            problems.append(f"{kind} step writes a free block")
        checked.append(len(lengths))
        return result

    engine.launch = checking  # type: ignore[method-assign]
    prompts = _prompts(4, seed=3, low=30, high=44)
    greedy = engine.generate([prompts[0]], SamplingParams(max_tokens=16))[0]
    params = [
        SamplingParams(max_tokens=16, stop_token_ids=(greedy[6],)),
        SamplingParams(max_tokens=20),
        SamplingParams(max_tokens=18, temperature=1.0, seed=1),
        SamplingParams(max_tokens=12),
    ]
    requests, streams = _serve(engine, prompts, params)
    assert not problems, problems
    assert engine.stats()["preemptions"] > 0 and len(checked) > 20
    _check_streams(requests, streams)
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


def test_a_request_preempted_with_its_token_on_the_device_resumes_from_it(
    small_cache_model: ReferenceModel,
) -> None:
    # Three requests decoding at once outgrow the 8 blocks: the newest is preempted while its last
    # token is still on the device (measured: the first preemption of this trace).
    prompts = _prompts(3, seed=3, low=14, high=18)
    params = [
        SamplingParams(max_tokens=40),
        SamplingParams(max_tokens=40, temperature=1.0, seed=5),
        SamplingParams(max_tokens=40),
    ]
    alone = _engine(small_cache_model, "serial", deterministic=True)
    expected = [alone.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    alone.close()
    engine = _engine(small_cache_model, "overlap", deterministic=True)
    pending_at_preemption: list[int] = []
    preempt = engine.scheduler._preempt

    def recording(victim: Request, schedule: Any) -> None:
        pending_at_preemption.append(victim.pending)
        preempt(victim, schedule)

    engine.scheduler._preempt = recording  # type: ignore[method-assign]
    requests, streams = _serve(engine, prompts, params)
    assert any(pending_at_preemption), "no preemption hit a request whose token was on the device"
    assert [r.output for r in requests] == expected  # recomputation continues from the token read later
    _check_streams(requests, streams)
    assert engine.allocator.num_free == engine.allocator.capacity
    engine.close()


def test_a_preempted_request_whose_token_is_on_the_device_is_admitted_once_it_is_read() -> None:
    # Readmitted, it recomputes its prompt and output from token ids: the host must know them all.
    scheduler = Scheduler(
        BlockAllocator(9), BlockTables(4, 16), block_size=16, max_running=4, token_budget=32, mixed=True
    )
    request = Request("r", list(range(1, 21)), SamplingParams(max_tokens=10), 0)
    request.output, request.pending = [5], 1  # preempted with its next token still on the device
    scheduler.add(request)
    assert scheduler.schedule().empty and request.status is Status.WAITING
    request.output, request.pending = [5, 7], 0  # read
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.request, chunk.start, chunk.length) == (request, 0, 22)


def test_a_request_waiting_to_be_read_is_not_preempted_for_a_prompt() -> None:
    # The last-resort preemption (every running request mid-prompt, no block free) must not pick a
    # request whose last step is still on the device: reading it frees its blocks.
    scheduler = Scheduler(
        BlockAllocator(3), BlockTables(4, 16), block_size=16, max_running=4, token_budget=64, mixed=True
    )
    done = Request("done", list(range(1, 17)), SamplingParams(max_tokens=1), 0)
    long = Request("long", list(range(1, 40)), SamplingParams(max_tokens=1), 1)
    scheduler.add(done)
    scheduler.add(long)
    first = scheduler.schedule()
    assert [c.request for c in first.chunks] == [done, long]  # one block each: the cache is full
    done.num_computed, long.num_computed = 16, 16
    done.pending = 1  # its token is being sampled: it needs no step more
    assert scheduler.schedule().empty and scheduler.preemptions == 0 and long.status is Status.RUNNING


def test_n_copies_fork_while_the_step_runs_and_each_samples_as_alone(model: ReferenceModel) -> None:
    prompt = _prompts(1, seed=8, low=20, high=40)[0]
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=21, n=3, logprobs=1)
    streams = {}
    for scheduler in SCHEDULERS:
        engine = _engine(model, scheduler, deterministic=True)
        (request,), got = _serve(engine, [prompt], [params])
        streams[scheduler] = {rid: _stream(s) for rid, s in got.items()}
        assert sorted(got) == [request.request_id, f"{request.request_id}.1", f"{request.request_id}.2"]
        assert engine.allocator.num_free == engine.allocator.capacity
        engine.close()
    assert streams["overlap"] == streams["serial"]


# -- the engine's other paths ---------------------------------------------------------------------------
def test_generate_and_close_leave_nothing_in_flight(model: ReferenceModel) -> None:
    engine = _engine(model, "overlap")
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=30))
    engine.step()
    engine.step()
    assert engine.has_work and request.pending == 1
    assert engine.abort(request.request_id) is not None
    assert engine.has_work  # the step on the device is still to be read
    assert engine.drain() == [] and not engine.has_work
    engine.generate([[4, 5]], SamplingParams(max_tokens=3, stop_token_ids=(0,)))
    assert not engine.has_work  # generate() read the last step
    engine.close()


def test_the_step_timeline_spans_each_forward_around_its_runs(model: ReferenceModel, tmp_path: Path) -> None:
    # The serving benchmark reads the device's idle time from the gaps between spans: each span must hold
    # the whole of its forward's device work, its runner's run included.
    from devgraph.serve.engine.timeline import StepTimeline

    engine = _engine(model, "overlap")
    timeline = StepTimeline(torch.device("cpu"), tmp_path / "timeline.json")
    timeline.wrap(engine.decode_runner, "decode")
    timeline.wrap(engine.prefill_runner, "prefill")
    engine.step_observer = timeline
    engine.generate(_prompts(3, seed=1), SamplingParams(max_tokens=5))
    timeline.save()
    data = json.loads((tmp_path / "timeline.json").read_text())
    runs, spans = data["steps"], data["spans"]
    assert len(spans) == len(runs) == sum(engine.stats()["steps"].values()) > 3
    for span, run in zip(spans, runs, strict=True):
        assert (
            span["device_start_ms"] <= run["device_start_ms"] <= run["device_end_ms"] <= span["device_end_ms"]
        )
        assert span["host_s"] <= run["host_s"] and span["tokens"] == run["tokens"]
        # The host clock when each returned: a run inside its span's issue.
        assert run["host_s"] <= run["host_end_s"] <= span["host_end_s"]
        # The engine thread's CPU time in the issue: at most the issue's wall time (to the clocks' grain).
        assert 0.0 <= span["host_cpu_ms"] <= 1e3 * (span["host_end_s"] - span["host_s"]) + 0.05
    # Each span's step number is its message's: one per forward, in issue order.
    numbers = [span["step"] for span in spans]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    engine.close()


def test_the_scheduler_flag_is_checked() -> None:
    from devgraph.errors import ConfigError

    with pytest.raises(ConfigError, match="scheduler must be one of serial, overlap"):
        EngineConfig(scheduler="async")  # type: ignore[arg-type]
    assert str(EngineConfig().scheduler) == "overlap"


# -- a checkpoint: the tokens transformers gives ----------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_overlapped_tokens_equal_transformers_on_a_checkpoint(hf_cases: dict[str, Any], family: str) -> None:
    from devgraph.serve.checkpoint import open_model

    case = hf_cases[family]
    source = open_model(str(case.directory))
    config = source.model_config({"max_requests": 4, "max_seq_len": 128})
    checkpoint_model = source.build(config, torch.device("cpu"), seed=0).model
    params = SamplingParams(max_tokens=20, stop_token_ids=source.generation.eos_token_ids)
    expected = [g.tokens for g in case.expected]
    for scheduler in SCHEDULERS:
        engine = _engine(checkpoint_model, scheduler)
        try:
            assert engine.generate(case.prompts, params) == expected, scheduler  # EOS stops mid-overlap
        finally:
            engine.close()


# -- on a GPU -------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_overlapped_outputs_equal_the_serial_schedulers() -> None:
    gpu = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), torch.device("cuda"), seed=0)
    prompts = _prompts(6, seed=5)
    params = [SamplingParams(max_tokens=16, stop_token_ids=(7, 11))]
    params += [SamplingParams(max_tokens=12, logprobs=1)]
    params += [SamplingParams(max_tokens=10, temperature=0.9, seed=s) for s in range(4)]
    got = {}
    for scheduler in SCHEDULERS:
        engine = _engine(gpu, scheduler, deterministic=True)
        requests, streams = _serve(engine, prompts, params)
        got[scheduler] = {rid: _stream(s) for rid, s in streams.items()}
        _check_streams(requests, streams)
        engine.close()
    assert got["overlap"] == got["serial"]


@pytest.mark.cuda
def test_cuda_issuing_a_step_never_blocks_the_host() -> None:
    # torch raises on every synchronizing call (a blocking copy, .item(), .tolist() of a device tensor)
    # under this mode: issuing decode and mixed steps must make none; reading a step waits on its event.
    gpu = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=4), torch.device("cuda"), seed=0)
    engine = _engine(gpu, "overlap")
    engine.warm_up()
    for prompt in _prompts(3, seed=6):
        engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=1, logprobs=1))
    issued = 0
    while engine.has_work:
        previous = engine._take()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = engine._issue([])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        issued += step is not None
        if previous is not None:
            engine._read(previous)
        engine._in_flight = step
    assert issued > 20
    engine.close()


def test_a_step_timeline_that_cannot_be_written_logs_and_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The server and the tensor-parallel worker save on their way out: a bad path must not cut short the
    # teardown after it. A file where the folder should be makes the write fail on any host.
    from devgraph.serve.engine.timeline import StepTimeline

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    timeline = StepTimeline(torch.device("cpu"), blocker / "timeline.json")
    mark = timeline.begin("decode", 7)
    timeline.end(mark, 1, 1)
    with caplog.at_level("ERROR"):
        timeline.save()
    assert "could not be written" in caplog.text and str(blocker / "timeline.json") in caplog.text
    assert not (blocker / "timeline.json").exists()
    timeline.path = tmp_path / "ok" / "timeline.json"  # the same timeline, a good path: written whole
    timeline.save()
    assert json.loads(timeline.path.read_text())["spans"][0]["step"] == 7


def _traced_loop(
    model: ReferenceModel, scheduler: str, delivery: str = "at-once"
) -> tuple[Any, list[tuple[str, Any]]]:
    """An engine loop whose issues, reads and deliveries are recorded in the order they happen."""
    import threading

    from devgraph.serve.engine import EngineLoop

    engine = _engine(model, scheduler, mode="disabled")
    events: list[tuple[str, Any]] = []
    issue, read = engine._issue, engine._read

    def issued(failed: list[RequestOutput]) -> Any:
        step = issue(failed)
        if step is not None:
            events.append(("issue", None))
        return step

    def reading(step: Any) -> list[RequestOutput]:
        events.append(("read", None))
        return read(step)

    engine._issue, engine._read = issued, reading  # type: ignore[method-assign]
    loop = EngineLoop(engine, delivery)
    loop.done = threading.Event()  # type: ignore[attr-defined]
    return loop, events


def _serve_loop(
    loop: Any, events: list[tuple[str, Any]], prompts: list[list[int]], max_tokens: int
) -> dict[str, list]:
    outputs: dict[str, list[RequestOutput]] = {}
    open_requests = [len(prompts)]

    def sink(output: RequestOutput) -> None:
        events.append(("deliver", output))
        outputs.setdefault(output.request_id, []).append(output)
        if output.finished:
            open_requests[0] -= 1
            if not open_requests[0]:
                loop.done.set()

    for prompt in prompts:  # all queued before the thread starts: one admission, whatever the scheduling
        loop.submit(prompt, SamplingParams(max_tokens=max_tokens), sink)
    loop.start()
    assert loop.done.wait(60)
    loop.shutdown()
    loop.engine.close()
    return outputs


@pytest.mark.parametrize(
    ("scheduler", "delivery"), [("serial", "next-issue"), ("overlap", "next-issue"), ("overlap", "at-once")]
)
def test_a_steps_outputs_reach_the_sinks_while_the_engine_waits_not_while_it_issues(
    model: ReferenceModel, scheduler: str, delivery: str
) -> None:
    # Overlapped: step N's outputs go out after step N+1... is issued and before the engine thread blocks
    # on the device (so the HTTP loop's Python runs while this thread holds no lock): never between a read
    # and the next issue while a step is in flight. Serial, or `at-once`: right after the read.
    loop, events = _traced_loop(model, scheduler, delivery)
    outputs = _serve_loop(loop, events, _prompts(3, seed=4), max_tokens=12)
    kinds = [kind for kind, _ in events]
    delivered = [i for i, kind in enumerate(kinds) if kind == "deliver"]
    assert delivered and all(len(o) >= 1 and o[-1].finished for o in outputs.values())
    if (scheduler, delivery) == ("overlap", "next-issue"):
        in_flight_deliveries = 0
        for i in delivered:
            before = [k for k in kinds[:i] if k != "deliver"]
            if before and before[-1] == "issue" and "read" in kinds[i:]:
                in_flight_deliveries += 1
            else:  # after a read only when nothing was issued after it: the last step's, at the end
                assert before[-1] == "read" and "issue" not in kinds[i:], kinds[max(0, i - 4) : i + 2]
        assert in_flight_deliveries >= len(delivered) // 2
    else:
        for i in delivered:
            assert [k for k in kinds[:i] if k != "deliver"][-1] == "read"


def test_held_outputs_keep_their_tokens_and_go_before_an_abort(
    model: ReferenceModel,
) -> None:
    got = {}
    for scheduler in SCHEDULERS:
        loop, events = _traced_loop(model, scheduler, "next-issue")
        got[scheduler] = {
            tuple(tuple(o.token_ids) for o in outs)
            for outs in _serve_loop(loop, events, _prompts(3, seed=9), 10).values()
        }
    assert got["overlap"] == got["serial"]
    # An abort while a token is held: the token first, then the abort's finished output.
    import threading

    from devgraph.serve.engine import EngineLoop

    engine = _engine(model, "overlap", mode="disabled")
    loop = EngineLoop(engine, "next-issue")
    seen: list[RequestOutput] = []
    first = threading.Event()
    finished = threading.Event()

    def sink(output: RequestOutput) -> None:
        seen.append(output)
        first.set()
        if output.finished:
            finished.set()

    loop.start()
    request_id = loop.submit([1, 2, 3, 4], SamplingParams(max_tokens=200), sink)
    assert first.wait(30)
    loop.abort(request_id)
    assert finished.wait(30)
    loop.shutdown()
    engine.close()
    assert seen[-1].finish_reason is FinishReason.ABORT
    assert all(not o.finished for o in seen[:-1]) and len(seen) >= 2
    # no token lost behind the abort: the client got every token the engine counted for the request
    assert sum(len(o.token_ids) for o in seen) == seen[-1].num_output_tokens


def test_an_unknown_output_delivery_is_refused(model: ReferenceModel) -> None:
    from devgraph import ConfigError
    from devgraph.serve.engine import EngineLoop

    engine = _engine(model, "overlap", mode="disabled")
    with pytest.raises(ConfigError, match="at-once, next-issue"):
        EngineLoop(engine, "later")
    engine.close()


@pytest.mark.parametrize("delivery", ["at-once", "next-issue"])
def test_a_shutdown_mid_stream_delivers_every_held_token_before_the_abort(
    model: ReferenceModel, delivery: str
) -> None:
    import threading

    from devgraph.serve.engine import EngineLoop

    engine = _engine(model, "overlap", mode="disabled")
    loop = EngineLoop(engine, delivery)
    seen: list[RequestOutput] = []
    streaming = threading.Event()

    def sink(output: RequestOutput) -> None:
        seen.append(output)
        if len(seen) >= 3:
            streaming.set()

    loop.submit([1, 2, 3, 4], SamplingParams(max_tokens=200), sink)
    loop.start()
    assert streaming.wait(30)
    loop.shutdown(drain_seconds=0.0)
    engine.close()
    assert seen[-1].finished and seen[-1].finish_reason is FinishReason.ABORT
    assert sum(len(o.token_ids) for o in seen) == seen[-1].num_output_tokens
