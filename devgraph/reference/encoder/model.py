"""A random-weight Qwen2-VL-style vision encoder (ViT) over packed images of any split."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from devgraph import CaptureError, InputError, is_capturing
from devgraph.reference.encoder.attention import image_sdpa, varlen_image_attention
from devgraph.reference.encoder.config import VisionConfig
from devgraph.reference.model import draw_weight, rotate

__all__ = ["VisionBlock", "VisionEncoder", "rotate"]


def _bias(generator: torch.Generator, size: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """A small random bias (nonzero, so padding rows are not trivially zero and mistakes show)."""
    value = torch.randn(size, generator=generator, dtype=torch.float32).mul_(0.02)
    return nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)


def _layer_norm(size: int, eps: float, device: torch.device, dtype: torch.dtype) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=eps, device=device, dtype=dtype)
    norm.requires_grad_(False)
    return norm


class VisionBlock(nn.Module):
    """Pre-norm block: block-diagonal attention over the images (or windows) of the batch, then a
    QuickGELU MLP."""

    def __init__(
        self, config: VisionConfig, index: int, generator: torch.Generator, device: torch.device
    ) -> None:
        super().__init__()
        c, dt, h = config, config.dtype, config.hidden_size
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.attention, self.kernels = c.attention, c.kernels
        self.windowed = not c.attends_per_image(index)
        self.scale = c.head_dim**-0.5
        self.norm1 = _layer_norm(h, c.norm_eps, device, dt)
        self.qkv_weight = draw_weight(generator, (3 * h, h), h, device, dt)
        self.qkv_bias = _bias(generator, 3 * h, device, dt)
        self.proj_weight = draw_weight(generator, (h, h), h, device, dt)
        self.proj_bias = _bias(generator, h, device, dt)
        self.norm2 = _layer_norm(h, c.norm_eps, device, dt)
        self.fc1_weight = draw_weight(generator, (c.intermediate_size, h), h, device, dt)
        self.fc1_bias = _bias(generator, c.intermediate_size, device, dt)
        self.fc2_weight = draw_weight(generator, (h, c.intermediate_size), c.intermediate_size, device, dt)
        self.fc2_bias = _bias(generator, h, device, dt)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        if self.attention == "sdpa":
            return image_sdpa(q, k, v, bounds, self.scale, self.windowed)
        return varlen_image_attention(self.kernels, q, k, v, bounds, self.scale)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: torch.Tensor
    ) -> torch.Tensor:
        """``bounds``: ``cu_seqlens`` (images) or ``cu_window_seqlens`` (windows), per :attr:`windowed`."""
        n, heads, dim = hidden.shape[0], self.num_heads, self.head_dim
        qkv = F.linear(self.norm1(hidden), self.qkv_weight, self.qkv_bias).view(n, 3, heads, dim)
        # q and k rotate together: one set of elementwise kernels instead of two.
        q, k = rotate(qkv[:, :2].reshape(n, 2 * heads, dim), cos, sin).view(n, 2, heads, dim).unbind(1)
        attn = self.attend(q, k, qkv[:, 2], bounds)
        hidden = hidden + F.linear(attn.reshape(n, -1), self.proj_weight, self.proj_bias)
        x = F.linear(self.norm2(hidden), self.fc1_weight, self.fc1_bias)
        x = x * torch.sigmoid(1.702 * x)  # QuickGELU, as in Qwen2-VL's vision MLP
        return hidden + F.linear(x, self.fc2_weight, self.fc2_bias)


class VisionEncoder(nn.Module):
    """A Qwen2-VL-style ViT with random weights: patch embedding, blocks, 2-D rotary, patch merger.

    :meth:`forward` takes a *packed* batch of images (any number, any grid sizes):

    * ``patches [S, patch_dim]``: flattened patches of every image, one after another, each image's patches
      in merge order (every ``spatial_merge ** 2`` consecutive patches are one merged output token);
    * ``position_ids [S, 2]`` int64: each patch's (row, column) in its image's grid;
    * ``cu_seqlens [images + 1]`` int32: the image boundaries (a device tensor). Tokens at or past
      ``cu_seqlens[-1]`` are padding: they attend to nothing and no real token attends to them;
    * ``output_order [S // spatial_merge**2]`` int64: for each output row, the merged token (in the
      encoder's internal order) that goes there: the identity without windows, the inverse of the window
      order with them. Padding rows may point anywhere (the runner cuts them off);
    * with ``window_size > 0`` (Qwen2.5-VL-style windowed attention) also ``window_index [S //
      spatial_merge**2]`` int64 (merged tokens in window order) and ``cu_window_seqlens [windows + 1]``
      int32 (window boundaries in patches, in window order). Windows never cross images, so
      ``cu_seqlens`` still delimits the images after the reordering.

    It returns the merged tokens ``[S // spatial_merge**2, out_hidden_size]`` in image order: image ``i``
    owns rows ``cu_seqlens[i] // 4 .. cu_seqlens[i + 1] // 4 - 1`` (for ``spatial_merge=2``).

    **The rotary table.** Angles of the 2-D rotary embedding come from a float32 table with one row per
    grid coordinate, indexed on the device by ``position_ids``. It grows with the grids the encoder sees,
    always outside graph capture: :meth:`ensure_positions` (the batch builder calls it with the largest side
    of the batch; the encoder runner calls it before capturing a token bucket ``T`` with ``T //
    spatial_merge``, the largest side any image of that bucket can have). Growing allocates a new table and
    keeps the old ones alive, because graphs captured earlier read the old table's memory; those graphs
    stay correct, since their bucket's positions were covered when they were captured. A position past the
    table is not checked on the device (that would need a host sync): call :meth:`ensure_positions` first.
    """

    #: The address guard's protocol: these attributes are rebound on purpose (the table grows) while the old
    #: tensors stay alive for the graphs captured on them (docs/user-guide.md, "Address guard").
    __devgraph_rebinds__ = ("rotary_cos", "rotary_sin")

    def __init__(self, config: VisionConfig, device: torch.device | str | None = None, seed: int = 0) -> None:
        super().__init__()
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        c, dt = config, config.dtype
        generator = torch.Generator().manual_seed(seed)
        # Draw order is fixed (patch embedding, blocks, merger), so a seed pins every weight on any device.
        self.patch_weight = draw_weight(generator, (c.hidden_size, c.patch_dim), c.patch_dim, device, dt)
        self.blocks = nn.ModuleList(VisionBlock(c, i, generator, device) for i in range(c.num_layers))
        merged = c.hidden_size * c.merge_unit
        self.merger_norm = _layer_norm(c.hidden_size, c.norm_eps, device, dt)
        self.merger_fc1_weight = draw_weight(generator, (merged, merged), merged, device, dt)
        self.merger_fc1_bias = _bias(generator, merged, device, dt)
        self.merger_fc2_weight = draw_weight(generator, (c.out_hidden_size, merged), merged, device, dt)
        self.merger_fc2_bias = _bias(generator, c.out_hidden_size, device, dt)
        # A quarter of head_dim frequencies for rows, the same for columns: [rows, head_dim / 4] each.
        quarter = c.head_dim // 4
        self._inv_freq = 1.0 / c.rope_theta ** (
            torch.arange(quarter, dtype=torch.float64) * 2 / (c.head_dim // 2)
        )
        self.rotary_cos = torch.empty(0, quarter, device=device)
        self.rotary_sin = torch.empty(0, quarter, device=device)
        self._retired_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.table_growths = 0

    @property
    def device(self) -> torch.device:
        return self.patch_weight.device

    # -- the rotary table ---------------------------------------------------------------------------
    @property
    def rotary_rows(self) -> int:
        """Grid coordinates the rotary table covers now (positions ``0 .. rotary_rows - 1``)."""
        return self.rotary_cos.shape[0]

    def ensure_positions(self, rows: int) -> None:
        """Grow the rotary table to cover coordinates ``0 .. rows - 1`` (no-op when it already does).

        Call it outside graph capture. It grows to the next power of two, so a stream of slowly growing
        grids reallocates only a logarithmic number of times.
        """
        if rows <= self.rotary_rows:
            return
        if is_capturing() or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            raise CaptureError(
                f"the vision encoder's rotary table must grow to {rows} rows during a graph capture; "
                "call ensure_positions() before capturing (encoder_runner does it per token bucket)"
            )
        capacity = 1 << max(rows - 1, 0).bit_length()
        angles = torch.outer(torch.arange(capacity, dtype=torch.float64), self._inv_freq)
        if self.rotary_rows:
            # Graphs captured earlier read the old tables' memory: keep them alive.
            self._retired_tables.append((self.rotary_cos, self.rotary_sin))
        self.rotary_cos = angles.cos().float().to(self.device)
        self.rotary_sin = angles.sin().float().to(self.device)
        self.table_growths += 1

    def prepare(self, grids: Iterable[Sequence[int]]) -> None:
        """Host-side preparation for a batch of image grids ``(height, width)``: grows the rotary table."""
        self.ensure_positions(max((max(grid) for grid in grids), default=0))

    def _rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin [S, 1, head_dim / 2]``: row angles then column angles of every patch."""
        n = position_ids.shape[0]
        flat = position_ids.reshape(-1)
        cos = self.rotary_cos.index_select(0, flat).view(n, 1, -1)
        sin = self.rotary_sin.index_select(0, flat).view(n, 1, -1)
        return cos, sin

    # -- forward ------------------------------------------------------------------------------------
    def forward(
        self,
        patches: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        output_order: torch.Tensor,
        window_index: torch.Tensor | None = None,
        cu_window_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed patches of several images -> merged tokens ``[S // spatial_merge**2, out_hidden_size]``
        (see the class docstring for the inputs)."""
        c = self.config
        unit = c.merge_unit
        if c.windowed:
            if window_index is None or cu_window_seqlens is None:
                raise InputError(
                    "a windowed vision encoder needs window_index and cu_window_seqlens; "
                    "build batches with make_image_batch(model, grids)"
                )
            # Window order: each window's merged tokens (runs of `unit` patches) become contiguous.
            patches = patches.view(-1, unit, c.patch_dim).index_select(0, window_index).view(-1, c.patch_dim)
            position_ids = position_ids.view(-1, unit, 2).index_select(0, window_index).view(-1, 2)
        hidden = F.linear(patches.to(c.dtype), self.patch_weight)
        cos, sin = self._rotary(position_ids)
        for block in self.blocks:
            hidden = block(hidden, cos, sin, cu_window_seqlens if block.windowed else cu_seqlens)
        merged = self.merger_norm(hidden).view(-1, c.hidden_size * unit)
        merged = F.gelu(F.linear(merged, self.merger_fc1_weight, self.merger_fc1_bias))
        merged = F.linear(merged, self.merger_fc2_weight, self.merger_fc2_bias)
        return merged.index_select(0, output_order)

    def weight_bytes(self) -> int:
        """Bytes of every weight (what one forward must read at least once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())
