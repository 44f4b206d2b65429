"""A lazily capturing ``encode`` runner for the vision encoder: one graph per token bucket, any split."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from devgraph import REQUESTS, ConfigError, GraphKey, GraphRunner, StaticInput
from devgraph.flag.sizes import MAX_SIZE_COUNT
from devgraph.messages import shorten
from devgraph.reference.encoder.batch import ImageBatch
from devgraph.reference.encoder.model import VisionEncoder

__all__ = [
    "DEFAULT_MAX_IMAGES",
    "MERGED",
    "TOKEN_STEP",
    "WINDOWS",
    "encode",
    "encoder_inputs",
    "encoder_runner",
    "encoder_sizes",
]

#: Token buckets are multiples of this (a multiple of every merge unit in use, and of the kernels' tiles).
TOKEN_STEP = 64
#: The axis of merged (output) tokens, ``tokens // spatial_merge**2`` per step.
MERGED = "merged"
#: The axis of attention windows (windowed encoders only).
WINDOWS = "windows"
#: Images per step the graphs hold (steps with more run eagerly).
DEFAULT_MAX_IMAGES = 8
_DEFAULT_MAX_TOKENS = 4096


def encoder_inputs(model: VisionEncoder) -> dict[str, StaticInput]:
    """The encoder's static inputs, on three axes (four with windows):

    * ``tokens`` (patches): ``patches`` and ``position_ids`` (padding: zero patches at position 0);
    * ``requests`` (images): ``cu_seqlens``, one row per image plus one, padded by repeating the last
      boundary, so padding images are empty and padding tokens belong to no image;
    * ``merged`` (output tokens, a quarter of the patches): ``output_order`` (and ``window_index``);
      padding rows point at merged token 0, harmless (their rows are padding, cut off by the runner);
    * ``windows`` (windowed encoders): ``cu_window_seqlens``, padded like ``cu_seqlens``.
    """
    config = model.config
    inputs = {
        "patches": StaticInput(config.dtype, (config.patch_dim,), fill=0.0),
        "position_ids": StaticInput(torch.int64, (2,), fill=0),
        "cu_seqlens": StaticInput(torch.int32, fill="edge", axis=REQUESTS, extra_rows=1),
        "output_order": StaticInput(torch.int64, fill=0, axis=MERGED),
    }
    if config.windowed:
        inputs["window_index"] = StaticInput(torch.int64, fill=0, axis=MERGED)
        inputs["cu_window_seqlens"] = StaticInput(torch.int32, fill="edge", axis=WINDOWS, extra_rows=1)
    return inputs


def encoder_sizes(max_tokens: int = _DEFAULT_MAX_TOKENS, step: int = TOKEN_STEP) -> list[int]:
    """Token buckets ``step, 2 * step, ..., max_tokens`` (``max_tokens`` rounded up to a multiple of
    ``step``): padding wastes fewer than ``step`` patches per batch, and a lazy runner captures only the
    buckets that traffic actually reaches."""
    for name, value in (("max_tokens", max_tokens), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"encoder_sizes {name} must be a positive int, got {shorten(value)}")
    top = -(-max_tokens // step) * step
    if top // step > MAX_SIZE_COUNT:
        raise ConfigError(
            f"encoder_sizes({max_tokens}, step={step}) gives {top // step} buckets; at most {MAX_SIZE_COUNT} "
            f"are accepted: raise step to at least {-(-top // MAX_SIZE_COUNT)}"
        )
    return list(range(step, top + 1, step))


def encoder_runner(
    model: VisionEncoder,
    *,
    max_images: int = DEFAULT_MAX_IMAGES,
    max_tokens: int | None = None,
    sizes: Sequence[int] | None = None,
    lazy: bool = True,
    capture_context: Callable[[GraphKey], Any] | None = None,
    **kwargs: Any,
) -> GraphRunner:
    """An ``encode``-phase runner over ``model.forward``, lazily capturing one graph per token bucket.

    * Token buckets: ``sizes`` (multiples of ``spatial_merge**2``), else :func:`encoder_sizes` up to
      ``max_tokens`` (default 4096).
    * One key per token bucket ``T``, whatever the split into images: ``requests`` (images) is padded to
      ``max_images``, ``merged`` is ``T // spatial_merge**2``, and ``windows`` (windowed encoders) is
      ``T // spatial_merge**2`` too (a window holds at least one merged token). More images than
      ``max_images`` run eagerly.
    * ``lazy=True`` (the default): a bucket is captured the first time a step needs it; bound the cache
      with ``max_graphs=`` / ``max_graph_bytes=`` (least recently used evicted, its memory returned).
    * ``mode``: ``full`` for ``varlen`` attention (the whole forward is one graph), ``breakable`` for
      ``sdpa`` (the per-image SDPA runs between graph segments), unless ``mode``/``config`` is given.
    * Before capturing bucket ``T`` the rotary table grows to ``T // spatial_merge`` rows, so the graph
      covers every image that fits the bucket. ``capture_context`` (if given) still provides the context.

    The output (declared to follow the ``merged`` axis, so no layout probe runs) is cut to the step's
    merged tokens on every path, graph or eager.
    """
    if isinstance(max_images, bool) or not isinstance(max_images, int) or max_images <= 0:
        raise ConfigError(f"encoder_runner max_images must be a positive int, got {shorten(max_images)}")
    config = model.config
    unit = config.merge_unit
    chosen = list(sizes) if sizes is not None else encoder_sizes(max_tokens or _DEFAULT_MAX_TOKENS)
    odd = [s for s in chosen if not isinstance(s, int) or isinstance(s, bool) or s <= 0 or s % unit]
    if odd:
        raise ConfigError(
            f"encoder token buckets must be positive multiples of spatial_merge**2 = {unit} (the merger "
            f"joins that many patches), got {shorten(odd)}"
        )
    if "mode" not in kwargs and "config" not in kwargs:
        kwargs["mode"] = "breakable" if config.attention == "sdpa" else "full"
    merge = config.spatial_merge
    user_context = capture_context

    def context_for(key: GraphKey) -> Any:
        model.ensure_positions(key.tokens // merge)
        return user_context(key) if user_context is not None else None

    def merged_tokens(tokens: int) -> list[int]:
        return [tokens // unit]

    axes: dict[str, Any] = {REQUESTS: max_images, MERGED: merged_tokens}
    if config.windowed:
        axes[WINDOWS] = merged_tokens
    kwargs.setdefault("device", model.device)
    return GraphRunner(
        model.forward,
        phase="encode",
        inputs=encoder_inputs(model),
        sizes=chosen,
        axes=axes,
        output_axes=[MERGED],
        capture_context=context_for,
        lazy=lazy,
        **kwargs,
    )


def encode(runner: GraphRunner, batch: ImageBatch, *, copy: bool = False) -> torch.Tensor:
    """Run ``batch`` through ``runner``: its merged tokens ``[batch.merged_tokens, out_hidden_size]`` (valid
    until the runner's next step unless ``copy=True``)."""
    return runner.run(context=batch.context, copy=copy, **batch.inputs)  # type: ignore[arg-type]
