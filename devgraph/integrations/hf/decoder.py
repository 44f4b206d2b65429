"""``DevgraphDecoder``: a Hugging Face causal LM's ``generate()`` with its decode steps on device graphs."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from devgraph import CaptureReport, ConfigError, DeviceGraphConfig, GraphRunner, StaticInput
from devgraph.integrations.hf.cache import SharedStaticCache
from devgraph.integrations.hf.decode_loop import DecodeLoop
from devgraph.integrations.hf.fast import DecodeRegions, FastPath, resolve_windows
from devgraph.integrations.hf.lib import transformers
from devgraph.integrations.hf.support import (
    FALLBACK_REASONS,
    check_generate_kwargs,
    check_model,
    route_generate,
)
from devgraph.messages import shorten

__all__ = ["DevgraphDecoder"]

logger = logging.getLogger(__name__)


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"DevgraphDecoder {name} must be a positive int, got {shorten(value)}")
    return value


def _capped(config: DeviceGraphConfig, max_batch: int) -> DeviceGraphConfig:
    """``config`` with its decode ``max_size`` and ``sizes`` cut to ``max_batch`` (the cache has no more
    rows, and the flag's sizes win over the decoder's), with a warning when that changes anything."""
    capped, asked = config.capped("decode", max_batch)
    if asked:
        logger.warning(
            "devgraph: DevgraphDecoder decode graphs are capped at max_batch=%d (the shared cache's rows): "
            "the config asked for %s",
            max_batch,
            asked,
        )
    return capped


class DevgraphDecoder:
    """``model.generate()`` with every decode step replayed from a device graph.

    ``generate(...)`` takes what ``model.generate`` takes and returns what it returns (a sequences tensor,
    or ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate=True``): HF prepares the call, the
    prefill runs HF's eager forward, and each decode step replays the graph of the smallest captured batch
    size holding the batch. One ``StaticCache`` of ``max_batch`` rows and ``max_cache_len`` positions is
    allocated here; a graph of size ``s`` uses its first ``s`` rows, and padding rows write only rows no
    live sequence owns. Calls the graphs cannot run (more rows than ``max_batch``, beam search and other
    modes, longer than the cache, ``inputs_embeds``, per-step attentions or hidden states) run HF's own
    ``generate()`` (with ``disable_compile=True``), counted by reason in :meth:`stats`.

    * ``max_batch`` (default: the largest of ``sizes``, else 8) rows of cache; ``sizes``: batch sizes to
      capture (default: devgraph's decode sizes up to ``max_batch``, which is always captured).
    * ``config``: a strategy (``"full"``, the default on CUDA and the CPU simulator; ``"disabled"`` runs
      the same static step eagerly) or a ``--device-graph-mode`` value.
    * ``fast``: ``False`` (HF's own kernels: HF eager ``generate()``'s tokens; its scores bitwise where the
      batch fills a captured size, within float32 rounding where padding rows are added: see
      docs/huggingface.md, Exactness), ``True`` or a :class:`FastPath` (compiled regions, packed GQA,
      windows: faster, rounding like a compiled model).
    * ``capture``: capture now (default) or at the first ``generate()``.

    One ``generate()`` runs at a time (a lock); ``return_dict_in_generate=True`` returns a view of the
    shared cache, which the next call overwrites. :meth:`close` releases graphs and undoes the fast path.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_cache_len: int,
        max_batch: int | None = None,
        sizes: Sequence[int] | None = None,
        config: str | DeviceGraphConfig = "auto",
        fast: bool | FastPath = False,
        capture: bool = True,
        warmup_iters: int | None = None,
        progress: bool | None = None,
    ) -> None:
        transformers()  # the install hint before anything else
        self.features = check_model(model)  # what this transformers calls each piece, found by feature
        self.model = model
        self.max_cache_len = _positive(max_cache_len, "max_cache_len")
        largest = max(sizes) if sizes else None
        self.max_batch = _positive(max_batch if max_batch is not None else (largest or 8), "max_batch")
        if largest is not None and largest > self.max_batch:
            raise ConfigError(
                f"DevgraphDecoder sizes go up to {largest} but max_batch is {self.max_batch}: the shared "
                "cache holds max_batch rows; raise max_batch or drop the larger sizes"
            )
        self.device = next(model.parameters()).device
        self.fast = FastPath() if fast is True else (fast or None)
        if self.fast is not None and not isinstance(self.fast, FastPath):
            raise ConfigError(f"DevgraphDecoder fast must be True, False or a FastPath, got {shorten(fast)}")
        self.windows = resolve_windows(self.fast.windows if self.fast else None, self.max_cache_len)
        graphs = _capped(DeviceGraphConfig.parse(config), self.max_batch)
        self.cache = SharedStaticCache(model, self.max_batch, self.max_cache_len)
        # The decode step's 2-D padding mask, written once per generate(): rows past the batch stay all True
        # (a row of zeros would mask every key and give NaN); bool, so the model's .to(bool) is free.
        self._mask = torch.ones(self.max_batch, self.max_cache_len, dtype=torch.bool, device=self.device)
        pad = model.generation_config.pad_token_id
        token_fill = pad if isinstance(pad, int) and pad >= 0 else 0
        self.runner = GraphRunner(
            self._forward,
            phase="decode",
            inputs={
                "input_ids": StaticInput(torch.long, (1,), fill=token_fill),
                "position_ids": StaticInput(torch.long, (1,), fill=0),
            },
            sizes=sizes,
            max_size=self.max_batch,
            device=self.device,
            config=graphs,
            warmup_iters=warmup_iters,
            progress=progress,
            variants={"window": self.windows} if self.windows else None,
            state=list(self.cache.write_positions),
            capture_context=self._before_key,
            output_axes={"['logits']": "tokens"},
        )
        self.regions: DecodeRegions | None = None
        self._lock = threading.Lock()
        self._fallbacks: Counter[str] = Counter()
        self._calls = 0
        self._graph_calls = 0
        self._closed = False
        self.capture_seconds = 0.0
        try:
            warmups = self.runner.warmup_iters
            if self.windows and self.windows[0] <= warmups:
                raise ConfigError(
                    f"FastPath window {self.windows[0]} is too short for {warmups} warm-up steps per "
                    f"captured graph (each writes one cache position): use windows longer than {warmups}, "
                    "or fewer warmup_iters"
                )
            if self.max_cache_len <= warmups:
                raise ConfigError(
                    f"DevgraphDecoder max_cache_len {self.max_cache_len} is too short for {warmups} warm-up "
                    f"steps per captured graph (each writes one cache position): use a max_cache_len above "
                    f"{warmups} (prompt + new tokens of the calls to run on the graphs), or fewer "
                    "warmup_iters"
                )
            if self.fast is not None:  # also without graphs ("disabled"): every mode computes the same
                self.regions = DecodeRegions(model, self.fast, self.runner.platform)
                self.regions.install()
            if capture:
                self.capture()
        except BaseException:
            self.close()  # nothing half-built stays behind: graphs released, the model as it was
            raise

    # -- the decode step the runner captures ----------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, window: int | None = None) -> Any:
        rows = input_ids.shape[0]
        columns = window or self.max_cache_len
        token = self.regions.activate() if self.regions is not None else None
        extra = {"logits_to_keep": 1} if self.features.logits_to_keep else {}
        try:
            return self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=self._mask[:rows, :columns],
                use_cache=True,
                return_dict=True,
                **{self.features.cache_argument: self.cache.view(rows, window)},
                **extra,
            )
        finally:
            if token is not None:
                DecodeRegions.deactivate(token)

    def _before_key(self, key: Any) -> None:
        # The runner's capture_context hook, called before each key's warm-ups: every warm-up advances the
        # write position, and the warm-ups of all keys would otherwise add up past a short window. (The
        # runner restores the positions it saved before capture() once all keys are captured.) No context.
        self.cache.rewind()

    def _start(self, rows: int, prompt_mask: torch.Tensor | None) -> None:
        self._mask.fill_(True)
        if prompt_mask is not None:
            self._mask[:rows, : prompt_mask.shape[1]].copy_(prompt_mask)

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, length: int) -> torch.Tensor:
        if not self.windows:
            return self.runner.run(input_ids=input_ids, position_ids=position_ids).logits
        window = next(w for w in self.windows if w >= length)
        return self.runner.run(
            input_ids=input_ids, position_ids=position_ids, variant={"window": window}
        ).logits

    # -- public ---------------------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture every batch size (and window), largest first; the write positions are left as found.
        Seconds, compiles included, are in :attr:`capture_seconds`."""
        self._check_open()
        start = time.perf_counter()
        report = self.runner.capture()
        self.capture_seconds += time.perf_counter() - start
        return report

    def generate(
        self, inputs: torch.Tensor | None = None, generation_config: Any = None, **kwargs: Any
    ) -> Any:
        """What ``model.generate(inputs, generation_config, **kwargs)`` returns, decoded on the graphs."""
        self._check_open()
        check_generate_kwargs(kwargs)
        kwargs.pop("synced_gpus", None)
        streamer = kwargs.pop("streamer", None)
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        route = route_generate(
            self.model,
            input_ids,
            generation_config,
            kwargs,
            max_batch=self.max_batch,
            max_cache_len=self.max_cache_len,
        )
        self._calls += 1
        if route.reason is not None:
            if not self._fallbacks[route.reason]:
                logger.warning(
                    "devgraph: generate() runs Hugging Face's own loop for this call (%s: %s); "
                    "counted in DevgraphDecoder.stats()['fallbacks']",
                    route.reason,
                    route.detail,
                )
            self._fallbacks[route.reason] += 1
            # No compile: CUDA graph trees would free cuBLAS workspaces the captured graphs use.
            kwargs["disable_compile"] = True
            return self.model.generate(input_ids, generation_config, streamer=streamer, **kwargs)
        with self._lock:
            if self.runner.report is None:
                self.capture()
            self.cache.rewind()
            loop = DecodeLoop(
                self._start, self._step, self.max_cache_len, self.device, self.features, streamer
            )
            # A cache_implementation in the given or the model's config would clash with the decoder's cache.
            if getattr(generation_config, "cache_implementation", None) is not None:
                generation_config = copy.deepcopy(generation_config)
                generation_config.cache_implementation = None
            elif generation_config is None and self.model.generation_config.cache_implementation is not None:
                kwargs["cache_implementation"] = None
            result = self.model.generate(
                input_ids,
                generation_config,
                custom_generate=loop,
                streamer=streamer,
                **{self.features.cache_argument: self.cache.view(route.rows)},
                **kwargs,
            )
            self._graph_calls += 1
            return result

    def stats(self) -> dict[str, Any]:
        """``generate()`` calls, how many ran on the graphs, fallbacks by reason, and the runner's counters
        (decode steps replayed per batch size, padding waste)."""
        return {
            "generate_calls": self._calls,
            "graph_generate_calls": self._graph_calls,
            "fallbacks": {reason: self._fallbacks[reason] for reason in FALLBACK_REASONS},
            "runner": self.runner.stats(),
        }

    def inspect(self) -> dict[str, Any]:
        """The runner's set-up and captured keys, the shared cache, the fast path."""
        return {
            "runner": self.runner.inspect(),
            "cache": self.cache.describe(),
            "windows": list(self.windows),
            "fast": self.regions.describe() if self.regions is not None else None,
            "capture_seconds": self.capture_seconds,
        }

    def close(self) -> None:
        """Release the graphs and undo the fast path; the model is as it was before."""
        if self._closed:
            return
        self._closed = True
        try:
            self.runner.close()
        finally:
            if self.regions is not None:
                self.regions.uninstall()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this DevgraphDecoder was closed; build a new one")

    def __enter__(self) -> DevgraphDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DevgraphDecoder({type(self.model).__name__}, max_batch={self.max_batch}, "
            f"max_cache_len={self.max_cache_len}, sizes={list(self.runner.sizes)}, "
            f"backend={self.runner.backend.name!r}, fast={self.fast is not None})"
        )
