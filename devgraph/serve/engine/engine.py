"""The reference serving engine: continuous batching over the reference model's paged KV cache.

One :meth:`Engine.step` schedules (see :mod:`~devgraph.serve.engine.scheduler`), runs the step's
forward through a ``GraphRunner`` (decode-only steps through the decode runner, prefill and mixed steps
through the prefill runner), samples, and returns each request's new token. Single-threaded: call it
from one thread (:class:`~devgraph.serve.engine.loop.EngineLoop` runs it in a thread of its own).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from devgraph.errors import ConfigError, InputError
from devgraph.flag.config import DeviceGraphConfig
from devgraph.messages import shorten
from devgraph.reference.model import ReferenceModel
from devgraph.reference.runners import decode_runner, prefill_runner
from devgraph.runner.background import BackgroundCapture
from devgraph.runner.capture.job import CaptureReport
from devgraph.runner.graph_runner import GraphRunner
from devgraph.serve.engine import sleep
from devgraph.serve.engine.allocator import BlockAllocator, BlockTables
from devgraph.serve.engine.batch import StepBatch, decode_batch, prefill_batch
from devgraph.serve.engine.config import EngineConfig
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

__all__ = ["Engine"]

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
            model, config=graphs, progress=progress, axes={"requests": running}, **prefill_sizes
        )
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self.step_counts: Counter[str] = Counter()
        self.engine_padding = 0
        self.finished_count: Counter[str] = Counter()
        #: The background capture in progress (capture_in_background()); None: graphs captured up front.
        self.background: BackgroundCapture | None = None
        self.prompt_tokens = 0  # prompts of requests that got their first token
        self.generation_tokens = 0  # tokens handed out (stop tokens are not)
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
        self.prompt_tokens = self.generation_tokens = 0
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
        needed = self.scheduler.blocks_for(total)
        if needed > self.allocator.capacity:
            raise InputError(
                f"the request needs {needed} KV blocks but the cache has {self.allocator.capacity}; "
                "lower max_tokens, or give the server more KV blocks (--num-blocks)"
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
        if request_id in self._requests:
            raise InputError(f"request id {shorten(request_id)} is already in the engine")
        request = Request(request_id, tokens, params, next(self._arrivals))
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """End a request and free its blocks; ``None`` if it is not (or no longer) in the engine.

        ``reason``: ``ABORT`` (cancelled), or ``STOP`` when the caller found a stop string in its text."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, reason, [])

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
                    if request.status is not Status.FINISHED:
                        outputs.append(self._finish(request, FinishReason.ERROR, [], error=repr(exc)))
        return outputs

    def _run(self, kind: str, entries: list[tuple[Request, int, int, bool]]) -> list[RequestOutput]:
        pinned = self.config.deterministic
        common = {"padding_slot": self.model.padding_slot}
        block_size, device = self.model_config.block_size, self.model.device
        batch: StepBatch
        if kind == "decode":
            pad = self.config.max_running_requests if pinned else None
            batch = decode_batch(
                [e[0] for e in entries], self.tables, block_size, device, pad_to=pad, **common
            )
        else:
            budget, running = self.config.token_budget, self.config.max_running_requests
            batch = prefill_batch(
                entries,
                self.tables,
                block_size,
                device,
                pad_tokens=budget if pinned else None,
                pad_requests=running if pinned else None,
                **common,
            )
        logits = self.forward(kind, batch)
        self.step_counts[kind] += 1
        self.engine_padding += batch.engine_padding
        return self._advance(batch, logits)

    def forward(self, kind: str, batch: StepBatch) -> torch.Tensor:
        """The step's logits: ``decode`` through the decode runner, ``prefill``/``mixed`` through the
        prefill runner. A tensor-parallel engine sends the batch to the other ranks first."""
        runner = self.decode_runner if kind == "decode" else self.prefill_runner
        return runner.run(context=batch.context, **batch.inputs)

    def _advance(self, batch: StepBatch, logits: torch.Tensor) -> list[RequestOutput]:
        rows = [i for i, s in enumerate(batch.samples) if s]
        sampled_requests = [batch.requests[i] for i in rows]
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        if rows:
            if len(rows) != logits.shape[0]:
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            tokens, logprobs = self.sampler.sample_step(logits, sampled_requests)
        for request, length in zip(batch.requests, batch.lengths, strict=True):
            request.num_computed += length
        now = time.monotonic()
        return [
            self._accept(r, t, now, lp) for r, t, lp in zip(sampled_requests, tokens, logprobs, strict=True)
        ]

    def _accept(
        self, request: Request, token: int, now: float, logprob: TokenLogprob | None
    ) -> RequestOutput:
        params = request.params
        ttft = itl = None
        if request.first_token_time is None:
            request.first_token_time = now
            ttft = now - request.arrival_time
            self.prompt_tokens += len(request.prompt)
        elif request.last_token_time is not None:
            itl = now - request.last_token_time
        request.last_token_time = now
        if token in request.stop_ids:
            return self._finish(request, FinishReason.STOP, [], ttft=ttft)
        request.output.append(token)
        self.generation_tokens += 1
        logprobs = None if logprob is None else [logprob]
        if len(request.output) >= params.max_tokens or request.num_tokens >= self.model_config.max_seq_len:
            return self._finish(request, FinishReason.LENGTH, [token], ttft=ttft, itl=itl, logprobs=logprobs)
        return RequestOutput(
            request.request_id,
            [token],
            num_prompt_tokens=len(request.prompt),
            num_output_tokens=len(request.output),
            ttft=ttft,
            itl=itl,
            logprobs=logprobs,
        )

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
    ) -> RequestOutput:
        self.scheduler.remove(request)
        self._requests.pop(request.request_id, None)
        request.finish_reason = reason
        self.finished_count[reason.value] += 1
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
            queue_time=None
            if request.scheduled_time is None
            else request.scheduled_time - request.arrival_time,
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
