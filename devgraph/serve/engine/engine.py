"""The reference serving engine: continuous batching over the reference model's paged KV cache.

One :meth:`Engine.step` runs in stages, each one method: **schedule** (see
:mod:`~devgraph.serve.engine.scheduler`; copy-on-write block copies run on the device right after),
**stage** the step's inputs (:mod:`~devgraph.serve.engine.batch`), **forward** through a ``GraphRunner``
(decode-only steps through the decode runner, prefill and mixed steps through the prefill runner, whose
graphs return the last tokens' logits and every token's hidden state), **sample** (and the log
probabilities asked for: the prompt's from the hidden states of just the rows that need them), and
**bookkeeping** (computed positions, forks of ``n > 1`` requests, finishes, each request's output).
Single-threaded: call it from one thread (:class:`~devgraph.serve.engine.loop.EngineLoop` runs it in a
thread of its own).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from devgraph import BackgroundCapture, CaptureReport, ConfigError, DeviceGraphConfig, GraphRunner, InputError
from devgraph.messages import shorten
from devgraph.reference.model import ReferenceModel
from devgraph.reference.runners import decode_runner, prefill_runner
from devgraph.serve.engine import sleep
from devgraph.serve.engine.allocator import BlockAllocator, BlockTables
from devgraph.serve.engine.batch import StepBatch, decode_batch, prefill_batch
from devgraph.serve.engine.config import EngineConfig
from devgraph.serve.engine.grammar import GrammarFailed
from devgraph.serve.engine.limits import cap_phase_sizes
from devgraph.serve.engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    Status,
    TokenLogprob,
)
from devgraph.serve.engine.sampler import Sampler
from devgraph.serve.engine.scheduler import Scheduler
from devgraph.serve.engine.sleep import KvCacheShape
from devgraph.serve.engine.stats import engine_stats
from devgraph.serve.engine.warmup import check_warm_up_fits, warm_up_lengths

__all__ = ["Engine", "StepResult"]

#: What a step's forward returns: the sampled rows' logits, and (prefill) every token's hidden state.
StepResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

logger = logging.getLogger(__name__)


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
        #: Where a step's input tensors are built: the model's device; a tensor-parallel rank 0 builds them
        #: on the host and hands them to its workers before moving them itself.
        self.batch_device: torch.device = model.device
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
        self.decode_runner: GraphRunner = decode_runner(
            model, config=graphs, progress=progress, **decode_sizes
        )
        self.prefill_runner: GraphRunner = prefill_runner(
            model,
            config=graphs,
            progress=progress,
            axes={"requests": running},
            hidden_states=True,  # the prompt's log probabilities are computed from them
            **prefill_sizes,
        )
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, list[Request]] = {}  # submitted id -> the request and its copies
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self.step_counts: Counter[str] = Counter()
        self.engine_padding = 0
        self.finished_count: Counter[str] = Counter()
        #: The background capture in progress (capture_in_background()); None: graphs captured up front.
        self.background: BackgroundCapture | None = None
        self.prompt_tokens = 0  # prompts of requests that got their first token (once per n copies)
        self.generation_tokens = 0  # tokens handed out (stop tokens are not)
        #: Prompt (and recomputed) tokens run through prefill chunks: n copies of a prompt count it once.
        self.prefill_tokens = 0
        #: Sleep mode (sleep()): the level asleep at (None: awake) and the KV cache to allocate on wake-up.
        self.sleep_level: int | None = None
        self._kv_shape: KvCacheShape | None = None
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
        sleep.resize_kv_cache(self, num_blocks)

    # -- sleep mode (serve/engine/sleep.py) ------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Give the device memory of an idle engine back: level 1 releases both runners' graphs and their
        pools, then frees the KV cache (its contents are lost); the weights stay. :class:`ConfigError`
        while requests are in flight or graphs are captured in the background. Returns what was freed."""
        return sleep.put_to_sleep(self, level)

    def wake_up(self) -> dict[str, Any]:
        """Take the memory back after :meth:`sleep`: the KV cache first (its old size, zeroed), then the
        graphs, captured on the new cache (no compile again). Returns the seconds each took."""
        return sleep.wake_up(self)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def warm_up(self) -> None:
        """Serve two throw-away requests (a 1-token and a longer prompt) so that first-use costs (lazy
        initialisation, kernel compilation in eager mode) do not land on the first real request; then
        zero every counter. :class:`ConfigError` when the KV cache cannot hold the longer one."""
        longest = check_warm_up_fits(self.model_config)
        output = warm_up_lengths(self.model_config)[1]
        self.generate([[0], [1] * longest], SamplingParams(max_tokens=output))
        self.step_counts.clear()
        self.finished_count.clear()
        self.engine_padding = 0
        self.prompt_tokens = self.generation_tokens = self.prefill_tokens = 0
        self.scheduler.preemptions = 0
        self.decode_runner.reset_stats()
        self.prefill_runner.reset_stats()

    def close(self) -> None:
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
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a token or finished."""
        schedule = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if schedule.empty:
            return outputs
        self._copy_blocks(schedule.copies)
        self.prefill_tokens += sum(c.length for c in schedule.chunks)
        decode_entries = [(r, r.num_computed, 1, True) for r in schedule.decodes]
        chunk_entries = [(c.request, c.start, c.length, c.samples) for c in schedule.chunks]
        if self.config.mixed and chunk_entries:
            forwards = [("mixed" if decode_entries else "prefill", decode_entries + chunk_entries)]
        else:
            forwards = [
                (kind, e) for kind, e in (("decode", decode_entries), ("prefill", chunk_entries)) if e
            ]
        for kind, entries in forwards:
            try:
                outputs += self._run(kind, entries)
            except Exception as exc:  # a failed forward fails its requests, not the engine
                logger.warning(
                    "a %s step failed; its %d request(s) finish with finish_reason 'error': %r",
                    kind,
                    len(entries),
                    exc,
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )
                for request, *_ in entries:
                    for member in (request, *request.copies):
                        if member.status is not Status.FINISHED:
                            outputs.append(self._finish(member, FinishReason.ERROR, [], error=repr(exc)))
        return outputs

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: the scheduler gave requests private copies of shared KV blocks; fill them."""
        if not copies:
            return
        device = self.model.device
        sources = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=device)
        targets = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=device)
        with torch.no_grad():
            for cache in (*self.model.k_cache, *self.model.v_cache):
                cache.index_copy_(0, targets, cache.index_select(0, sources))

    def _run(self, kind: str, entries: list[tuple[Request, int, int, bool]]) -> list[RequestOutput]:
        batch = self._stage(kind, entries)
        result = self.forward(kind, batch)
        self.step_counts[kind] += 1
        self.engine_padding += batch.engine_padding
        logits, hidden = result if isinstance(result, tuple) else (result, None)
        return self._advance(batch, logits, hidden)

    def _stage(self, kind: str, entries: list[tuple[Request, int, int, bool]]) -> StepBatch:
        """The step's runner inputs on the device (padded to one shape per phase in deterministic mode)."""
        pinned = self.config.deterministic
        common = {"padding_slot": self.model.padding_slot}
        block_size, device = self.model_config.block_size, self.batch_device
        if kind == "decode":
            pad = self.config.max_running_requests if pinned else None
            return decode_batch(
                [e[0] for e in entries], self.tables, block_size, device, pad_to=pad, **common
            )
        budget, running = self.config.token_budget, self.config.max_running_requests
        return prefill_batch(
            entries,
            self.tables,
            block_size,
            device,
            pad_tokens=budget if pinned else None,
            pad_requests=running if pinned else None,
            **common,
        )

    def forward(self, kind: str, batch: StepBatch) -> StepResult:
        """The step's logits: ``decode`` through the decode runner; ``prefill``/``mixed`` through the
        prefill runner, with every token's hidden state beside them. A tensor-parallel engine sends the
        batch to the other ranks first."""
        runner = self.decode_runner if kind == "decode" else self.prefill_runner
        return runner.run(context=batch.context, **batch.inputs)  # type: ignore[no-any-return]

    def _advance(
        self, batch: StepBatch, logits: torch.Tensor, hidden: torch.Tensor | None
    ) -> list[RequestOutput]:
        """Sample, then the bookkeeping: positions computed, the prompt's log probabilities, forks of
        ``n > 1`` requests whose prompt is done, and each request's output."""
        if hidden is not None:
            self._score_prompts(batch, hidden)
        for request, length in zip(batch.requests, batch.lengths, strict=True):
            request.num_computed += length
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        rows: list[int] = []
        sampled: list[Request] = []
        for row, (request, samples) in enumerate(zip(batch.requests, batch.samples, strict=True)):
            if not samples:
                continue
            if request.params.max_tokens == 0:  # the prompt alone (its log probabilities): nothing to sample
                for member in (request, *request.copies):
                    outputs.append(self._finish(member, FinishReason.LENGTH, [], now=now))
                continue
            for member in (request, *self.scheduler.fork(request)) if request.copies else (request,):
                rows.append(row)
                sampled.append(member)
        if not sampled:
            return outputs
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        tokens, logprobs = self.sampler.sample_step(logits, sampled)
        return outputs + [
            self._accept(r, t, now, lp) for r, t, lp in zip(sampled, tokens, logprobs, strict=True)
        ]

    def _score_prompts(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        """The log probabilities of the prompt tokens this step's chunks predict (row ``p`` of a chunk
        predicts token ``p + 1``), for the requests that asked and only for those rows: the LM head runs on
        them alone, after the graph. Each prompt token is scored once (a recomputed prompt is not)."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Request] = []
        offset = 0
        for request, start, length in zip(batch.requests, batch.starts, batch.lengths, strict=True):
            scored = len(request.prompt_logprobs) if request.wants_prompt_logprobs else None  # type: ignore[arg-type]
            if scored is not None:
                for position in range(max(start, scored - 1), min(start + length, len(request.prompt) - 1)):
                    rows.append(offset + position - start)
                    targets.append(request.prompt[position + 1])
                    owners.append(request)
            offset += length
        if not rows:
            return
        device = hidden.device
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=device)))
        counts = [r.params.prompt_logprobs or 0 for r in owners]
        entries = self.sampler.token_logprobs(logits, torch.tensor(targets, device=device), counts)
        for request, entry in zip(owners, entries, strict=True):
            request.prompt_logprobs.append(entry)  # type: ignore[union-attr]

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
        if complete:
            return self._finish(
                request,
                FinishReason.STOP,
                [token],
                ttft=ttft,
                itl=itl,
                logprobs=logprobs,
                now=now,
                prompt_logprobs=prompt_logprobs,
            )
        if len(request.output) >= params.max_tokens or request.num_tokens >= self.model_config.max_seq_len:
            return self._finish(
                request,
                FinishReason.LENGTH,
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
        self.scheduler.remove(request)
        self._requests.pop(request.request_id, None)
        group = self._groups.get(request.group)
        if group is not None and all(m.status is Status.FINISHED for m in group):
            del self._groups[request.group]
        request.finish_reason = reason
        self.finished_count[reason.value] += 1
        now = time.monotonic() if now is None else now
        if prompt_logprobs is None and request.first_token_time is None and reason is FinishReason.LENGTH:
            prompt_logprobs = self._group_prompt_logprobs(request)  # max_tokens 0: the prompt is the answer
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
        return [list(r.output) for r in requests]

    def stats(self) -> dict[str, Any]:
        """Engine and runner counters as plain data (the server's /metrics and debug endpoint read it)."""
        return engine_stats(self)
