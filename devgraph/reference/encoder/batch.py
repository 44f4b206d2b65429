"""Packed image batches for the vision encoder: patches, per-patch positions, image boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from devgraph import ConfigError
from devgraph.messages import shorten
from devgraph.reference.encoder.model import VisionEncoder

__all__ = ["EncoderContext", "ImageBatch", "image_positions", "make_image_batch", "window_order"]


@dataclass
class EncoderContext:
    """Host-side image (and window) boundaries of one step, handed to ``GraphRunner.run(context=...)``.

    The ``sdpa`` attention break op sizes its per-segment SDPA calls from ``cu_seqlens`` (or
    ``cu_window_seqlens`` in windowed blocks); the ``varlen`` attention reads the same boundaries from the
    device tensors and ignores the context.
    """

    cu_seqlens: list[int] | None = None
    cu_window_seqlens: list[int] | None = None


@dataclass
class ImageBatch:
    """A packed batch: ``inputs`` for the encoder (``patches``, ``position_ids``, ``cu_seqlens``,
    ``output_order``, and for a windowed encoder ``window_index``, ``cu_window_seqlens``), the ``context``
    with the host boundaries, and the grids it was built from."""

    grids: tuple[tuple[int, int], ...]
    inputs: dict[str, torch.Tensor]
    context: EncoderContext = field(default_factory=EncoderContext)
    merge_unit: int = 4

    @property
    def tokens(self) -> int:
        """Patches in the batch (``S``)."""
        return sum(h * w for h, w in self.grids)

    @property
    def merged_tokens(self) -> int:
        """Rows of the encoder's output that belong to the batch (``S // spatial_merge**2``)."""
        return self.tokens // self.merge_unit

    @property
    def images(self) -> int:
        return len(self.grids)

    @property
    def windows(self) -> int:
        """Attention windows (0 for an encoder without windowed attention)."""
        bounds = self.context.cu_window_seqlens
        return len(bounds) - 1 if bounds is not None else 0

    @property
    def max_side(self) -> int:
        """The largest grid side: the rotary table must cover that many coordinates."""
        return max(max(grid) for grid in self.grids)


def image_positions(height: int, width: int, merge: int) -> torch.Tensor:
    """``[height * width, 2]`` int64 (row, column) of each patch, in merge order: each run of
    ``merge * merge`` consecutive patches is one ``merge x merge`` square of the grid (as Qwen2-VL's
    image processor orders them), so the merger can join them with a reshape."""
    rows = torch.arange(height)[:, None].expand(height, width)
    cols = torch.arange(width)[None, :].expand(height, width)

    def in_merge_order(grid: torch.Tensor) -> torch.Tensor:
        return grid.reshape(height // merge, merge, width // merge, merge).permute(0, 2, 1, 3).reshape(-1)

    return torch.stack((in_merge_order(rows), in_merge_order(cols)), dim=-1)


def _check_grids(grids: Sequence[Sequence[int]], merge: int) -> tuple[tuple[int, int], ...]:
    checked = []
    for grid in grids:
        values = tuple(grid) if isinstance(grid, (tuple, list)) else ()
        if len(values) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % merge == 0 for v in values
        ):
            raise ConfigError(
                f"an image grid must be (height, width) in patches, both positive multiples of "
                f"spatial_merge={merge}; got {shorten(grid)}"
            )
        checked.append((values[0], values[1]))
    if not checked:
        raise ConfigError("an image batch needs at least one grid")
    return tuple(checked)


def window_order(height: int, width: int, window: int) -> list[torch.Tensor]:
    """The merged tokens of one image (``height x width`` of them, row-major) window by window: one index
    tensor per ``window x window`` square (smaller at the right and bottom edges), squares row-major."""
    index = torch.arange(height * width).view(height, width)
    return [
        index[top : top + window, left : left + window].reshape(-1)
        for top in range(0, height, window)
        for left in range(0, width, window)
    ]


def make_image_batch(
    model: VisionEncoder,
    grids: Sequence[Sequence[int]],
    *,
    patches: torch.Tensor | None = None,
    seed: int = 0,
) -> ImageBatch:
    """A packed batch of images, one per ``(height, width)`` grid (in patches): ``patches [S, patch_dim]``
    in merge order (default: random, from ``seed``), their positions, boundaries and output order.

    As an engine's preprocessor would, it also grows the model's rotary table to the batch's largest side
    (:meth:`VisionEncoder.prepare`), on the host, before any forward runs.
    """
    config = model.config
    merge, unit = config.spatial_merge, config.merge_unit
    shapes = _check_grids(grids, merge)
    tokens = sum(h * w for h, w in shapes)
    if patches is None:
        generator = torch.Generator().manual_seed(seed)
        patches = torch.randn(tokens, config.patch_dim, generator=generator, dtype=torch.float32)
    elif tuple(patches.shape) != (tokens, config.patch_dim):
        raise ConfigError(
            f"patches has shape {tuple(patches.shape)}; the grids need {(tokens, config.patch_dim)}"
        )
    positions = torch.cat([image_positions(h, w, merge) for h, w in shapes])
    boundaries = [0]
    for h, w in shapes:
        boundaries.append(boundaries[-1] + h * w)
    model.prepare(shapes)
    inputs = {
        "patches": patches.to(dtype=config.dtype),
        "position_ids": positions,
        "cu_seqlens": torch.tensor(boundaries, dtype=torch.int32),
        "output_order": torch.arange(tokens // unit),
    }
    context = EncoderContext(boundaries)
    if config.windowed:
        windows, offset = [], 0
        for h, w in shapes:
            windows += [offset + part for part in window_order(h // merge, w // merge, config.window_size)]
            offset += h * w // unit
        window_index = torch.cat(windows)
        window_bounds = [0]
        for part in windows:
            window_bounds.append(window_bounds[-1] + part.numel() * unit)
        inputs["window_index"] = window_index
        inputs["cu_window_seqlens"] = torch.tensor(window_bounds, dtype=torch.int32)
        inputs["output_order"] = torch.argsort(window_index)
        context.cu_window_seqlens = window_bounds
    inputs = {name: t.to(model.device) for name, t in inputs.items()}
    return ImageBatch(shapes, inputs, context, unit)
