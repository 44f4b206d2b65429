"""One Hugging Face ``StaticCache`` allocated once for the largest batch, with views of its first rows.

A graph captured for batch size ``s`` reads and writes rows ``[:s]`` of every layer's key/value tensors
(``[batch, kv_heads, max_cache_len, head_dim]``: the first rows are contiguous, so ``index_copy_`` writes
straight into the shared storage). Every view shares the layers' ``cumulative_length`` tensors: the write
position each forward advances on the device, the only state a decode step mutates besides one key/value
column (and the state the runner saves and restores around capture and verify).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.integrations.hf.features import check_cache_layer, unsupported
from devgraph.integrations.hf.lib import transformers

__all__ = ["SharedStaticCache"]

_REFUSED_LAYERS = {
    "StaticSlidingWindowLayer": "sliding-window or chunked attention keeps its length in a Python int",
    "LinearAttentionLayer": "linear attention / convolution state is not a key/value cache",
}


def _head_shape(config: Any) -> tuple[int, int]:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(heads), int(head_dim)


class SharedStaticCache:
    """A ``StaticCache`` of ``max_batch`` rows and ``max_cache_len`` positions, allocated now.

    ``view(rows)`` is a ``StaticCache`` over its first ``rows`` rows; ``view(rows, window)`` also cuts the
    columns to the first ``window`` positions (the fast path's windows: attention then reads only them).
    Raises :class:`ConfigError` for caches whose layers are not plain full-attention ``StaticLayer`` s.
    """

    def __init__(self, model: Any, max_batch: int, max_cache_len: int) -> None:
        tf = transformers()
        name = type(model).__name__
        self.config = model.config.get_text_config(decoder=True)
        self.max_batch = max_batch
        self.max_cache_len = max_cache_len
        try:
            self.full = tf.StaticCache(config=self.config, max_cache_len=max_cache_len)
        except Exception as exc:
            raise unsupported(
                name,
                f"StaticCache(config=..., max_cache_len=...) failed ({type(exc).__name__}: {exc}); devgraph "
                "decodes only models with full-attention static caches",
            ) from None
        static_layer = tf.cache_utils.StaticLayer
        for index, layer in enumerate(self.full.layers):
            if type(layer) is not static_layer:
                kind = type(layer).__name__
                why = _REFUSED_LAYERS.get(kind, "not a plain full-attention StaticLayer")
                raise ConfigError(
                    f"{name} layer {index} caches with {kind} ({why}); a captured graph "
                    "would bake the branch taken at capture. devgraph decodes only models whose every layer "
                    "is full attention (Llama, Qwen3, ...): use model.generate() for this one"
                )
            check_cache_layer(name, layer, index, initialized=False)
        if not callable(getattr(self.full, "early_initialization", None)):
            raise unsupported(
                name,
                "StaticCache has no `early_initialization` (devgraph allocates the cache "
                "before capture with it)",
            )
        heads, head_dim = _head_shape(self.config)
        # Allocate now: a lazy first update inside a capture would allocate the cache in the graph's pool.
        self.full.early_initialization(
            batch_size=max_batch, num_heads=heads, head_dim=head_dim, dtype=model.dtype, device=model.device
        )
        for index, layer in enumerate(self.full.layers):
            check_cache_layer(name, layer, index, initialized=True)
        self._views: dict[tuple[int, int], Any] = {}

    def view(self, rows: int, window: int | None = None) -> Any:
        """A ``StaticCache`` over rows ``[:rows]`` (and positions ``[:window]``): same storage, same
        write positions. Views are cached: the same object for the same arguments. Build the views a
        compiled forward uses before compiling it: creating one is not traceable by every torch's dynamo."""
        columns = self.max_cache_len if window is None else window
        if not 1 <= rows <= self.max_batch or not 1 <= columns <= self.max_cache_len:
            raise ConfigError(
                f"a cache view needs 1..{self.max_batch} rows and 1..{self.max_cache_len} positions, "
                f"got {rows} rows and {columns} positions"
            )
        key = (rows, columns)
        view = self._views.get(key)
        if view is None:
            tf = transformers()
            view = tf.StaticCache(config=self.config, max_cache_len=columns)
            for mine, full in zip(view.layers, self.full.layers, strict=True):
                vars(mine).update(
                    vars(full)
                )  # every attribute, so ones a transformers release adds carry over
                mine.keys = full.keys[:rows, :, :columns]
                mine.values = full.values[:rows, :, :columns]
                mine.batch_size = rows
                mine.max_cache_len = columns
            self._views[key] = view
        return view

    @property
    def write_positions(self) -> tuple[torch.Tensor, ...]:
        """One 0-d int64 device tensor per layer: where the next forward writes its key/value column."""
        return tuple(layer.cumulative_length for layer in self.full.layers)

    def position(self) -> int:
        """The write position on the host (a device sync: for checks and tests, not for the decode loop)."""
        return int(self.write_positions[0])

    def rewind(self) -> None:
        """Start a new batch of sequences. Stale keys/values stay: the causal mask hides columns past the
        write position, and the next steps overwrite them before any query can see them."""
        with torch.no_grad():
            for position in self.write_positions:
                position.zero_()

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Run forwards and put the write positions back afterwards."""
        saved = [position.clone() for position in self.write_positions]
        try:
            yield
        finally:
            with torch.no_grad():
                for position, value in zip(self.write_positions, saved, strict=True):
                    position.copy_(value)

    def nbytes(self) -> int:
        """Bytes of the key/value tensors."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.full.layers)

    def describe(self) -> dict[str, Any]:
        first = self.full.layers[0].keys
        return {
            "max_batch": self.max_batch,
            "max_cache_len": self.max_cache_len,
            "layers": len(self.full.layers),
            "dtype": str(first.dtype),
            "device": str(first.device),
            "bytes": self.nbytes(),
            "views": sorted(self._views),
        }
