"""The reference serving engine: continuous batching over the reference model's paged KV cache.

A step goes in two halves.

**Issue** (the host decides and queues device work; nothing is read back): **schedule** (see
:mod:`~devgraph.serve.engine.scheduler`), **stage** the step's inputs on the host
(:mod:`~devgraph.serve.engine.batch`), the bookkeeping that needs no token (positions computed, forks of
``n > 1`` requests, which rows sample and their uniform numbers, which prompt tokens are scored), all of it
packed into one message (:mod:`~devgraph.serve.engine.wire`) that crosses to the device in one
non-blocking copy; then on the device (:mod:`~devgraph.serve.engine.device_step`) copy-on-write blocks,
pending ids from the token slots and the **forward** through a ``GraphRunner`` (decode-only steps through
the decode runner, prefill and mixed steps through the prefill runner, whose graphs return the last
tokens' logits and every token's hidden state), **sampling** (and the log probabilities asked for: the
prompt's from the hidden states of just the rows that need them), each sampled token into its request's
slot, and non-blocking copies of the tokens into pinned host memory with an event after them.

**Read** (once the event completed): the prompt's log probabilities, then each sampled token accepted:
stop tokens, the grammar, ``max_tokens``, the request's output. A token of a request that finished in the
meantime (a stop token read a step earlier, an abort) is dropped: it never reaches the request.

The **serial** scheduler reads each step right after issuing it. The **overlapped** one (the default,
:class:`~devgraph.serve.engine.config.SchedulerMode`) issues step N+1 before it reads step N, so the
host's scheduling and staging of N+1 and its reading of N run while the device runs N (see the scheduler
for the rules that keep that exact). A step runs serially (read at once) while a request with a grammar
runs (its mask needs the previous token on the host) and while graphs are captured in the background
(a capture never overlaps a step). Single-threaded: call it from one thread
(:class:`~devgraph.serve.engine.engine_thread.EngineLoop` runs it in a thread of its own).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from devgraph import (
    BackgroundCapture,
    CaptureReport,
    ConfigError,
    DeviceGraphConfig,
    GraphRunner,
    HostCopy,
    InputError,
)
from devgraph.messages import shorten
from devgraph.reference.inputs import StepContext
from devgraph.reference.model import ReferenceModel
from devgraph.reference.runners import decode_runner, prefill_runner
from devgraph.serve.engine.allocator import BlockAllocator, BlockTables
from devgraph.serve.engine.batch import StepBatch, decode_batch, prefill_batch
from devgraph.serve.engine.config import EngineConfig
from devgraph.serve.engine.device_step import DeviceStep, StepResult
from devgraph.serve.engine.grammar import GrammarFailed
from devgraph.serve.engine.limits import cap_phase_sizes
from devgraph.serve.engine.message_memory import MessageMemory
from devgraph.serve.engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    Status,
    TokenLogprob,
)
from devgraph.serve.engine.sampler import (
    LogprobTensors,
    Sampler,
    SamplingPlan,
    logprob_entries,
    logprob_tensors,
    sample_on_device,
)
from devgraph.serve.engine.scheduler import Scheduler
from devgraph.serve.engine.sleep import (
    SleepMode,
    allocate_kv_cache,
    check_level,
    free_kv_cache,
    kv_cache_shape,
)
from devgraph.serve.engine.stats import engine_stats
from devgraph.serve.engine.warmup import check_warm_up_fits, warm_up_lengths
from devgraph.serve.engine.wire import StepMessage, encode_step

__all__ = ["Engine", "IssuedForward", "IssuedStep", "StepObserver", "StepResult"]

logger = logging.getLogger(__name__)

#: The log-probability tensors of one set of rows, as they come back to the host (LogprobTensors' order).
_LOGPROB_PARTS = 5


@dataclass
class IssuedForward:
    """One forward on the device and what the host does with its results once read: ``sampled`` (one
    request per sampled token, in row order), ``finishing`` (``max_tokens`` 0: the prompt alone),
    ``scored`` (the owner of each prompt row scored), and ``readback``: the tokens, then the sampled
    tokens' log-probability tensors, then the prompt's, on their way to the host."""

    kind: str
    sampled: list[Request] = field(default_factory=list)
    finishing: list[Request] = field(default_factory=list)
    scored: list[Request] = field(default_factory=list)
    logprob_counts: list[int] = field(default_factory=list)
    score_counts: list[int] = field(default_factory=list)
    readback: HostCopy | None = None


@dataclass
class IssuedStep:
    """A step issued and not read yet: its forwards (one, or a decode and a prefill without mixed steps)."""

    forwards: list[IssuedForward] = field(default_factory=list)


class StepObserver(Protocol):
    """Told of each forward's device work (the step timeline times it): ``begin`` before the step's first
    device work is issued, ``end`` after its last (the copies back to the host)."""

    def begin(self, kind: str, step: int = 0) -> Any: ...

    def end(self, mark: Any, tokens: int, requests: int) -> None: ...


class Engine:
    """Serves requests on ``model`` with graphs chosen by ``device_graph_mode`` (a flag value or config).

    ``capture=False`` leaves capturing to an explicit :meth:`capture` call (steps run eagerly until then)
    or to :meth:`capture_in_background` (the graphs are captured key by key between steps).
    """

    def __init__(
        self,
        model: ReferenceModel,
        config: EngineConfig | None = None,
        *,
        device_graph_mode: DeviceGraphConfig | str | None = "auto",
        capture: bool = True,
        progress: bool | None = None,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.model_config = model.config
        running, budget = self.config.max_running_requests, self.config.token_budget
        self.allocator = BlockAllocator(model.config.total_blocks)
        self.tables = BlockTables(running, model.config.max_blocks_per_request)
        self.scheduler = Scheduler(
            self.allocator,
            self.tables,
            block_size=model.config.block_size,
            max_running=running,
            token_budget=budget,
            mixed=self.config.mixed,
        )
        self.sampler = Sampler()
        graphs = (
            device_graph_mode
            if isinstance(device_graph_mode, DeviceGraphConfig)
            else DeviceGraphConfig.parse(device_graph_mode or "auto")
        )
        # The flag's sizes win over the engine's: cut them to what a step can hold.
        graphs = cap_phase_sizes(graphs, "decode", running, "max_running_requests (--max-running-requests)")
        graphs = cap_phase_sizes(graphs, "prefill", budget, "token_budget (--token-budget)")
        # Deterministic mode pins one shape per phase; otherwise a ladder of sizes up to the limits.
        pinned = self.config.deterministic
        decode_sizes: dict[str, Any] = {"sizes": [running]} if pinned else {"max_size": running}
        prefill_sizes: dict[str, Any] = {"sizes": [budget]} if pinned else {"max_size": budget}
        group = getattr(model, "group", None)  # tensor parallel: capture handshake, per-step key check
        if group is not None:
            decode_sizes["process_group"] = prefill_sizes["process_group"] = group
        # Greedy tokens come out of the decode graph with the logits: no argmax launched after the replay.
        self.decode_runner: GraphRunner = decode_runner(
            model, config=graphs, progress=progress, greedy=True, **decode_sizes
        )
        self.prefill_runner: GraphRunner = prefill_runner(
            model,
            config=graphs,
            progress=progress,
            axes={"requests": running},
            hidden_states=True,  # the prompt's log probabilities are computed from them
            **prefill_sizes,
        )
        #: The device half of every step (the same on every tensor-parallel rank) and the token slots.
        self.device_step = DeviceStep(
            model,
            self.decode_runner,
            self.prefill_runner,
            slots=running + 1,
            table_width=model.config.max_blocks_per_request,
            group=group,
        )
        #: Where each step's message is encoded and the device buffer it crosses to, reused step after step.
        self.message_memory = MessageMemory(model.device)
        self._step_numbers = itertools.count()
        #: The step issued and not read yet (the overlapped scheduler); None between serial steps.
        self._in_flight: IssuedStep | None = None
        #: Steps read at once, by reason: "scheduler" (serial), "constrained", "capturing".
        self.serial_steps: Counter[str] = Counter()
        #: Told of each forward's device work (the step timeline); None: nobody.
        self.step_observer: StepObserver | None = None
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, list[Request]] = {}  # submitted id -> the request and its copies
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self.step_counts: Counter[str] = Counter()
        self.engine_padding = 0
        self.finished_count: Counter[str] = Counter()
        #: The background capture in progress (capture_in_background()); None: graphs captured up front.
        self.background: BackgroundCapture | None = None
        self._capture_on_wake = False  # sleep() stopped a background capture: wake_up() starts it again
        self.prompt_tokens = 0  # prompts of requests that got their first token (once per n copies)
        self.generation_tokens = 0  # tokens handed out (stop tokens are not)
        #: Prompt (and recomputed) tokens run through prefill chunks: n copies of a prompt count it once.
        self.prefill_tokens = 0
        #: Sleep mode (sleep()): whether the engine sleeps and the KV cache it freed.
        self.sleep_mode = SleepMode(model, (self.decode_runner, self.prefill_runner))
        if capture:
            self.capture()

    # -- set-up --------------------------------------------------------------------------------------
    def capture(self) -> list[CaptureReport]:
        """Capture both runners' graphs (a no-op for ``disabled``); returns their reports."""
        return [self.decode_runner.capture(), self.prefill_runner.capture()]

    def capture_in_background(self) -> BackgroundCapture:
        """Serve before the graphs are ready: steps run eagerly (counted as ``capturing``) while
        :meth:`BackgroundCapture.step` captures one key at a time; the :class:`EngineLoop` calls it between
        steps and while idle, in its own thread, so a capture never overlaps a step. Returns it."""
        if self.background is None:
            self.background = BackgroundCapture([self.decode_runner, self.prefill_runner])
        return self.background

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache at ``num_blocks`` blocks instead (``--gpu-memory-utilization`` sizes it
        after the graphs' estimate); only before any graph is captured and with no request in the engine."""
        captured = self.decode_runner.keys or self.prefill_runner.keys
        if self.has_work or captured or self.background is not None:
            raise ConfigError(
                "resize the KV cache before capturing graphs and before adding requests: the graphs read "
                "the cache's addresses"
            )
        free_kv_cache(self.model)
        self.model.config = dataclasses.replace(self.model.config, num_blocks=num_blocks)
        self.model_config = self.model.config
        allocate_kv_cache(self.model, kv_cache_shape(self.model))
        self.allocator = self.scheduler.allocator = BlockAllocator(self.model_config.total_blocks)

    # -- sleep mode (serve/engine/sleep.py) ------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Give the device memory of an idle engine back: level 1 releases both runners' graphs and their
        pools, then frees the KV cache (its contents are lost); the weights stay. A capture in the background
        stops (the keys it captured are released with the rest) and starts again on :meth:`wake_up`, so a
        server put to sleep right after it started sleeps at once. :class:`ConfigError` while requests are
        in flight. Returns what was freed."""
        busy = None
        if self.has_work:
            busy = (
                f"the engine has {self.num_running + self.num_waiting} request(s) in flight: sleep when it "
                "is idle (their KV cache would be freed under them)"
            )
        check_level(level)  # before a background capture is stopped for a sleep that cannot happen
        stopping = self.background if busy is None and not self.is_sleeping else None
        released = 0
        if stopping is not None and not stopping.done:
            runners = (self.decode_runner, self.prefill_runner)
            held = sum(r.graph_memory().total_bytes for r in runners)
            stopping.abandon()  # the keys of runners still capturing are released here, not by sleep
            released = held - sum(r.graph_memory().total_bytes for r in runners)
            self.background, self._capture_on_wake = None, True
        return self.sleep_mode.sleep(level, busy, released)

    def wake_up(self) -> dict[str, Any]:
        """Take the memory back after :meth:`sleep`: the KV cache first (its old size, zeroed), then the
        graphs, captured on the new cache (no compile again); a background capture that the sleep stopped
        starts again, key by key between steps. Returns the seconds each took."""
        took = self.sleep_mode.wake_up()
        if self._capture_on_wake and not self.is_sleeping:
            self._capture_on_wake = False
            self.capture_in_background()
        return took

    @property
    def sleep_level(self) -> int | None:
        """The level the engine sleeps at; ``None``: awake."""
        return self.sleep_mode.level

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_mode.asleep

    def warm_up(self) -> None:
        """Serve two throw-away requests (a 1-token and a longer prompt) so that first-use costs (lazy
        initialisation, kernel compilation in eager mode) do not land on the first real request; then
        zero every counter. :class:`ConfigError` when the KV cache cannot hold the longer one."""
        longest = check_warm_up_fits(self.model_config)
        output = warm_up_lengths(self.model_config)[1]
        self.generate([[0], [1] * longest], SamplingParams(max_tokens=output))
        self.step_counts.clear()
        self.serial_steps.clear()  # the warm-up's steps are no request's: "capturing" counts served ones
        self.finished_count.clear()
        self.engine_padding = 0
        self.prompt_tokens = self.generation_tokens = self.prefill_tokens = 0
        self.scheduler.preemptions = 0
        self.decode_runner.reset_stats()
        self.prefill_runner.reset_stats()

    def close(self) -> None:
        """Read the step in flight (its device work done), then release both runners."""
        try:
            self.drain()
        finally:
            self.decode_runner.close()
            self.prefill_runner.close()

    # -- requests ------------------------------------------------------------------------------------
    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list; :class:`InputError` saying what is wrong when the engine cannot serve it."""
        config = self.model_config
        tokens = list(prompt)
        if not tokens:
            raise InputError("the prompt is empty; give at least one token")
        bad = [
            t
            for t in tokens
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < config.vocab_size
        ]
        if bad:
            raise InputError(
                f"prompt token ids must be ints in [0, {config.vocab_size}), got {shorten(bad[:8])}"
            )
        total = len(tokens) + params.max_tokens
        if total > config.max_seq_len:
            raise InputError(
                f"the prompt ({len(tokens)} tokens) plus max_tokens ({params.max_tokens}) is {total} tokens; "
                f"the model's context is {config.max_seq_len}: shorten the prompt or lower max_tokens"
            )
        # n copies share the prompt's whole blocks; each needs the rest (its last prompt block copied).
        shared = len(tokens) // config.block_size if params.n > 1 else 0
        needed = shared + params.n * (self.scheduler.blocks_for(total) - shared)
        if needed > self.allocator.capacity:
            raise InputError(
                f"the request needs {needed} KV blocks but the cache has {self.allocator.capacity}; "
                "lower max_tokens (or n), or give the server more KV blocks (--num-blocks)"
            )
        if params.n > self.config.max_running_requests:
            raise InputError(
                f"n={params.n} copies must run together, but at most {self.config.max_running_requests} "
                "requests run at once (--max-running-requests): lower n, or send several requests"
            )
        if getattr(self.model, "group", None) is not None and (
            params.n > 1 or params.prompt_logprobs is not None
        ):
            raise InputError(
                "n > 1 and the prompt's log probabilities (echo with logprobs, prompt_logprobs) are not "
                "served under tensor parallelism yet (--tp): serve on one device for them"
            )
        return tokens

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        params = params or SamplingParams()
        if self.sleep_level is not None:
            raise ConfigError(
                "the engine is asleep (its KV cache is freed); wake_up() before adding requests"
            )
        tokens = self.check_request(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests or request_id in self._groups:
            raise InputError(f"request id {shorten(request_id)} is already in the engine")
        arrival = next(self._arrivals)
        request = Request(request_id, tokens, params, arrival)
        # Copies wait for the first one's prompt, then share its blocks (Scheduler.fork).
        request.copies = [
            Request(f"{request_id}.{i}", tokens, params, arrival, group=request_id, index=i)
            for i in range(1, params.n)
        ]
        group = [request, *request.copies]
        self._groups[request_id] = group
        for member in group:
            self._requests[member.request_id] = member
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """End a request and free its blocks; ``None`` if it is not (or no longer) in the engine.

        ``reason``: ``ABORT`` (cancelled), or ``STOP`` when the caller found a stop string in its text."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, reason, [])

    def abort_group(
        self, group: str, reason: FinishReason = FinishReason.ABORT, index: int | None = None
    ) -> list[RequestOutput]:
        """:meth:`abort` for every copy still in the engine of the request submitted as ``group`` (or for
        copy ``index`` alone)."""
        members = [
            r
            for r in self._groups.get(group, ())
            if r.status is not Status.FINISHED and (index is None or r.index == index)
        ]
        return [self._finish(r, reason, []) for r in members]

    @property
    def step_in_flight(self) -> bool:
        """A step was issued and not read yet: the next :meth:`step` (or :meth:`drain`) reads it."""
        return self._in_flight is not None

    @property
    def has_work(self) -> bool:
        """Requests running or waiting, or a step issued and not read yet."""
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ------------------------------------------------------------------------------------
    def step(self, before_read: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a token or finished.

        Serial: schedule and issue a step, then read it. Overlapped: schedule and issue step N+1, then read
        step N (issued by the previous call) while the device runs N+1; the outputs are step N's (and
        those of N+1's forwards that failed). :meth:`drain` reads the step left in flight.
        ``before_read``: called once the step is issued, before this thread waits for the device (the
        time a caller's other threads can run Python without holding up an issue)."""
        outputs: list[RequestOutput] = []
        if self._serial_reason() is not None:
            outputs += self.drain()
        issued = self._issue(outputs)
        if before_read is not None:
            before_read()
        previous = self._take()
        if previous is not None:
            outputs += self._read(previous)
        if issued is not None:
            reason = self._serial_reason()
            if reason is None:
                self._in_flight = issued
            else:
                self.serial_steps[reason] += 1
                outputs += self._read(issued)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Read the step in flight, if any (its outputs); after it the engine has nothing on the device."""
        previous = self._take()
        return [] if previous is None else self._read(previous)

    def _take(self) -> IssuedStep | None:
        issued, self._in_flight = self._in_flight, None
        return issued

    def _serial_reason(self) -> str | None:
        """Why a step issued now must be read at once (``None``: the next step may be issued first)."""
        if not self.config.scheduler.overlaps:
            return "scheduler"  # --scheduler serial
        if self.background is not None and not self.background.done:
            return "capturing"  # a key is captured between two steps, with none in flight
        if any(r.grammar is not None for r in self.scheduler.running):
            return "constrained"  # a grammar's mask for the next step needs this step's token
        return None

    def _issue(self, failed: list[RequestOutput]) -> IssuedStep | None:
        """Schedule a step and issue its forwards; ``failed`` gets the outputs of requests whose forward
        failed to issue (they finish with ``finish_reason`` error). ``None``: nothing to run."""
        schedule = self.scheduler.schedule()
        if schedule.empty:
            return None
        self.prefill_tokens += sum(c.length for c in schedule.chunks)
        decode_entries = [(r, r.num_computed, 1, True) for r in schedule.decodes]
        chunk_entries = [(c.request, c.start, c.length, c.samples) for c in schedule.chunks]
        if self.config.mixed and chunk_entries:
            forwards = [("mixed" if decode_entries else "prefill", decode_entries + chunk_entries)]
        else:
            forwards = [
                (kind, e) for kind, e in (("decode", decode_entries), ("prefill", chunk_entries)) if e
            ]
        issued = IssuedStep()
        copies = schedule.copies  # copy-on-write blocks: before the step's first forward that runs
        for kind, entries in forwards:
            forward = IssuedForward(kind)
            try:
                self._issue_forward(forward, entries, copies)
            except Exception as exc:  # a failed forward fails its requests, not the engine
                self.tables.resync()  # its table changes may not have reached the device: all next time
                failed += self._fail(forward, entries, exc)
                continue
            issued.forwards.append(forward)
            copies = []
        return issued if issued.forwards else None

    def _issue_forward(
        self,
        forward: IssuedForward,
        entries: list[tuple[Request, int, int, bool]],
        copies: list[tuple[int, int]],
    ) -> None:
        """Stage, plan and issue one forward and its sampling; fills ``forward`` as it goes (so a failure
        half-way knows the copies it forked)."""
        batch = self._stage(forward.kind, entries)
        message, plan = self._plan(forward, batch, copies)
        observer = self.step_observer
        try:
            mark = observer.begin(forward.kind, message.step) if observer is not None else None
            self._run_on_device(forward, batch, message, plan)
        finally:  # its buffer back to the message memory if the step failed before its copy was queued
            self.message_memory.release(message)
        if observer is not None:
            observer.end(mark, int(batch.inputs["input_ids"].shape[0]), len(batch.requests))
        for member in forward.sampled:
            member.pending += 1
        self.step_counts[forward.kind] += 1
        self.engine_padding += batch.engine_padding

    def _plan(
        self, forward: IssuedForward, batch: StepBatch, copies: list[tuple[int, int]]
    ) -> tuple[StepMessage, SamplingPlan]:
        """The host's half: positions computed, forks, which rows sample (and their uniform numbers), which
        prompt rows are scored; all of it packed with the inputs into one message. Returns the message
        and the sampling plan."""
        arrays = dict(batch.inputs)
        arrays.update(self._plan_prompt_scores(forward, batch))
        for request, length in zip(batch.requests, batch.lengths, strict=True):
            request.num_computed += length
        rows: list[int] = []
        for row, (request, samples) in enumerate(zip(batch.requests, batch.samples, strict=True)):
            if not samples:
                continue
            if request.params.max_tokens == 0:  # the prompt alone (its log probabilities): nothing to sample
                forward.finishing += (request, *request.copies)
                continue
            for member in (request, *self.scheduler.fork(request)) if request.copies else (request,):
                rows.append(row)
                forward.sampled.append(member)
        plan = self.sampler.plan(forward.sampled)
        forward.logprob_counts = plan.logprob_counts
        if forward.sampled:
            if rows == list(range(len(rows))) and batch.rows is not None:
                # The first rows sample, one token each (every decode step): the logits' leading rows are
                # the sampled ones (a view on the device, no gather), and the sampled tokens' slots are
                # those requests' rows, which the step already carries.
                whole = len(rows) == batch.rows.shape[0]
                arrays["sample_slots"] = batch.rows if whole else batch.rows[: len(rows)]
            else:  # rows that do not sample (a prompt chunk's) or repeat (n copies forked)
                arrays["sample_rows"] = torch.tensor(rows, dtype=torch.int64)
                arrays["sample_slots"] = torch.tensor([m.row for m in forward.sampled], dtype=torch.int64)
            arrays.update(plan.arrays)
        if copies:
            arrays["copy_from"] = torch.tensor([c[0] for c in copies], dtype=torch.int64)
            arrays["copy_to"] = torch.tensor([c[1] for c in copies], dtype=torch.int64)
        if batch.id_slots is not None:
            arrays["id_slots"] = batch.id_slots
        if batch.pending_slots is not None:
            arrays["pending_slots"] = batch.pending_slots
        # The block tables: what changed since the last step, and this step's rows of the device's copy.
        assert batch.rows is not None  # both batch builders give every step its rows
        arrays.update(self.tables.changes())
        arrays["table_rows"] = batch.rows
        step = next(self._step_numbers)
        message = encode_step(
            forward.kind, arrays, batch.context, step=step, allocate=self.message_memory.host_buffer
        )
        return message, plan

    def _run_on_device(
        self,
        forward: IssuedForward,
        batch: StepBatch,
        message: StepMessage,
        plan: SamplingPlan,
    ) -> None:
        """The device's half, queued and never waited for: the message's one copy, the forward, sampling,
        the tokens into their slots, the prompt's scores, and the copies of what the host reads. Each op
        here is a launch on a GPU, issued while the device runs the previous step: parts nobody asked
        for this step (copy-on-write, log probabilities, sampling's draws, a gather of the sampled rows)
        issue nothing."""
        on_device = self.message_memory.inputs(message)
        result = self.launch(forward.kind, message, on_device, batch.context)
        # The decode runner: the logits and each row's greedy token (the graph's); the prefill runner (a
        # prefill or a mixed step): the logits and the hidden states a prompt's log probabilities come from.
        logits, second = result
        on_decode_runner = self.device_step.runner(forward.kind) is self.decode_runner
        hidden = None if on_decode_runner else second
        greedy = second if on_decode_runner else None
        back: list[torch.Tensor] = []
        if forward.sampled:
            sample_rows = on_device.get("sample_rows")  # absent: the leading rows sample, in order
            if sample_rows is not None:
                logits = logits.index_select(0, sample_rows)
                greedy = greedy.index_select(0, sample_rows) if greedy is not None else None
            elif logits.shape[0] != len(forward.sampled):  # padding rows (deterministic mode)
                logits = logits[: len(forward.sampled)]
                greedy = greedy[: len(forward.sampled)] if greedy is not None else None
            # Each token into its request's slot too, where the next step's ids come from. A prefill's
            # greedy rows by torch's argmax after the graph: the Triton kernels take 3.0 us of the device's
            # time at one row against 8.6, but their two launches from Python cost 54 us of the host's
            # against 12 (benchmarks/results/h200-argmax.json); inside the decode graph they cost none.
            slots = (self.device_step.slots.tokens, on_device["sample_slots"])
            tokens, logprobs = sample_on_device(logits, plan, on_device, greedy=greedy, write_to=slots)
            back += (tokens, *(logprobs.tensors() if logprobs is not None else ()))
        if forward.scored:
            assert hidden is not None  # prefill steps return every token's hidden state
            rows_logits = self.model.compute_logits(hidden.index_select(0, on_device["score_rows"]))
            scored = logprob_tensors(rows_logits, on_device["score_targets"], max(forward.score_counts))
            back += scored.tensors()
        forward.readback = self.decode_runner.to_host(*back) if back else None

    def launch(
        self, kind: str, message: StepMessage, arrays: dict[str, torch.Tensor], context: StepContext
    ) -> StepResult:
        """Hand a step to the device: ``arrays`` are ``message``'s tensors there. A tensor-parallel engine
        sends ``message`` to the other ranks first."""
        return self.device_step.forward(kind, arrays, context)

    def _fail(
        self, forward: IssuedForward, entries: list[tuple[Request, int, int, bool]], exc: Exception
    ) -> list[RequestOutput]:
        logger.warning(
            "a %s step failed; its %d request(s) finish with finish_reason 'error': %r",
            forward.kind,
            len(entries),
            exc,
            exc_info=logger.isEnabledFor(logging.DEBUG),
        )
        members = [m for request, *_ in entries for m in (request, *request.copies)]
        members += forward.sampled + forward.finishing  # copies forked before the failure
        outputs = []
        for member in {id(m): m for m in members}.values():
            if member.status is not Status.FINISHED:
                outputs.append(self._finish(member, FinishReason.ERROR, [], error=repr(exc)))
        return outputs

    def _stage(self, kind: str, entries: list[tuple[Request, int, int, bool]]) -> StepBatch:
        """The step's runner inputs on the host (padded to one shape per phase in deterministic mode)."""
        pinned = self.config.deterministic
        common = {"padding_slot": self.model.padding_slot}
        block_size = self.model_config.block_size
        if kind == "decode":
            pad = self.config.max_running_requests if pinned else None
            return decode_batch(
                [e[0] for e in entries], self.tables, block_size, pad_to=pad, gather_tables=False, **common
            )
        budget, running = self.config.token_budget, self.config.max_running_requests
        return prefill_batch(
            entries,
            self.tables,
            block_size,
            pad_tokens=budget if pinned else None,
            pad_requests=running if pinned else None,
            gather_tables=False,
            **common,
        )

    def _plan_prompt_scores(self, forward: IssuedForward, batch: StepBatch) -> dict[str, torch.Tensor]:
        """The prompt tokens this forward's chunks predict (row ``p`` of a chunk predicts token ``p + 1``)
        whose log probabilities are wanted: their rows and targets, for the requests that asked and only
        for those rows (the LM head runs on them alone, after the graph). Each prompt token is scored
        once (a recomputed prompt is not)."""
        rows: list[int] = []
        targets: list[int] = []
        offset = 0
        for request, start, length in zip(batch.requests, batch.starts, batch.lengths, strict=True):
            if request.wants_prompt_logprobs:
                first = max(start, request.prompt_scored - 1)
                last = min(start + length, len(request.prompt) - 1)
                for position in range(first, last):
                    rows.append(offset + position - start)
                    targets.append(request.prompt[position + 1])
                    forward.scored.append(request)
                request.prompt_scored += max(0, last - first)
            offset += length
        if not rows:
            return {}
        forward.score_counts = [r.params.prompt_logprobs or 0 for r in forward.scored]
        return {
            "score_rows": torch.tensor(rows, dtype=torch.int64),
            "score_targets": torch.tensor(targets, dtype=torch.int64),
        }

    # -- reading a step ------------------------------------------------------------------------------
    def _read(self, issued: IssuedStep) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for forward in issued.forwards:
            outputs += self._read_forward(forward)
        return outputs

    def _read_forward(self, forward: IssuedForward) -> list[RequestOutput]:
        """Wait for the forward's copies, then: the prompt's log probabilities, the requests that finish
        with their prompt, and every sampled token accepted, except a token of a request that finished
        since the forward was issued (it stopped a step earlier, or was aborted): that one is dropped."""
        host = list(forward.readback.wait()) if forward.readback is not None else []
        now = time.monotonic()
        sampled = forward.sampled
        tokens: list[int] = host.pop(0).tolist() if sampled else []
        logprobs: list[TokenLogprob | None] = [None] * len(sampled)
        if forward.logprob_counts:
            entries = iter(logprob_entries(LogprobTensors(*host[:_LOGPROB_PARTS]), forward.logprob_counts))
            del host[:_LOGPROB_PARTS]
            for i, member in enumerate(sampled):
                if member.params.logprobs is not None:
                    logprobs[i] = next(entries)
        if forward.scored:
            scores = logprob_entries(LogprobTensors(*host[:_LOGPROB_PARTS]), forward.score_counts)
            for owner, entry in zip(forward.scored, scores, strict=True):
                owner.prompt_logprobs.append(entry)  # type: ignore[union-attr]
        outputs: list[RequestOutput] = []
        for request in forward.finishing:
            if request.status is not Status.FINISHED:
                outputs.append(self._finish(request, FinishReason.LENGTH, [], now=now))
        for member, token, logprob in zip(sampled, tokens, logprobs, strict=True):
            member.pending -= 1
            if member.status is Status.FINISHED:
                continue
            outputs.append(self._accept(member, token, now, logprob))
        return outputs

    def _accept(
        self, request: Request, token: int, now: float, logprob: TokenLogprob | None
    ) -> RequestOutput:
        params = request.params
        ttft = itl = None
        prompt_logprobs = None
        if request.first_token_time is None:
            request.first_token_time = now
            ttft = now - request.arrival_time
            if request.index == 0:
                self.prompt_tokens += len(request.prompt)
            prompt_logprobs = self._group_prompt_logprobs(request)
        elif request.last_token_time is not None:
            itl = now - request.last_token_time
        request.last_token_time = now
        if token in request.stop_ids:
            return self._finish(
                request, FinishReason.STOP, [], ttft=ttft, now=now, prompt_logprobs=prompt_logprobs
            )
        complete = False  # constrained decoding: the grammar ends the request once its output is whole
        if request.grammar is not None:
            try:
                complete = request.grammar.advance(token)
            except GrammarFailed as exc:  # this request's grammar alone: the step's others go on
                return self._finish(
                    request, FinishReason.ERROR, [], error=str(exc), ttft=ttft, now=now,
                    prompt_logprobs=prompt_logprobs,
                )  # fmt: skip
        request.output.append(token)
        self.generation_tokens += 1
        logprobs = None if logprob is None else [logprob]
        at_length = (
            len(request.output) >= params.max_tokens or request.num_known >= self.model_config.max_seq_len
        )
        if complete or at_length:
            return self._finish(
                request,
                FinishReason.STOP if complete else FinishReason.LENGTH,
                [token],
                ttft=ttft,
                itl=itl,
                logprobs=logprobs,
                now=now,
                prompt_logprobs=prompt_logprobs,
            )
        return RequestOutput(
            request.request_id,
            [token],
            num_prompt_tokens=len(request.prompt),
            num_output_tokens=len(request.output),
            ttft=ttft,
            itl=itl,
            logprobs=logprobs,
            group=request.group,
            index=request.index,
            prompt_logprobs=prompt_logprobs,
        )

    def _group_prompt_logprobs(self, request: Request) -> list[TokenLogprob | None] | None:
        """The prompt's log probabilities for ``request``'s first output (its copies share the first's)."""
        if request.params.prompt_logprobs is None:
            return None
        first = self._groups.get(request.group, [request])[0]
        return list(first.prompt_logprobs or [None])

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        tokens: list[int],
        *,
        error: str | None = None,
        ttft: float | None = None,
        itl: float | None = None,
        logprobs: list[TokenLogprob] | None = None,
        now: float | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> RequestOutput:
        if prompt_logprobs is None and request.first_token_time is None and reason is FinishReason.LENGTH:
            # max_tokens 0: the prompt is the answer (read from the group before its last copy closes it)
            prompt_logprobs = self._group_prompt_logprobs(request)
        self.scheduler.remove(request)
        self._requests.pop(request.request_id, None)
        group = self._groups.get(request.group)
        if group is not None and all(m.status is Status.FINISHED for m in group):
            del self._groups[request.group]
        request.finish_reason = reason
        self.finished_count[reason.value] += 1
        now = time.monotonic() if now is None else now
        scheduled, first = request.scheduled_time, request.first_token_time
        return RequestOutput(
            request.request_id,
            tokens,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt),
            num_output_tokens=len(request.output),
            error=error,
            ttft=ttft,
            itl=itl,
            logprobs=logprobs,
            queue_time=None if scheduled is None else scheduled - request.arrival_time,
            group=request.group,
            index=request.index,
            prompt_logprobs=prompt_logprobs,
            prefill_time=None if scheduled is None else (first if first is not None else now) - scheduled,
            decode_time=None if first is None else (request.last_token_time or now) - first,
        )

    # -- conveniences --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Add every prompt, step until all finish; each request's output token ids (stop tokens left out)."""
        per_request = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, per_request, strict=True)]
        while any(r.status is not Status.FINISHED for r in requests):
            self.step()
        self.drain()
        return [list(r.output) for r in requests]

    def stats(self) -> dict[str, Any]:
        """Engine and runner counters as plain data (the server's /metrics and debug endpoint read it)."""
        return engine_stats(self)
