"""Block-diagonal (per-image) attention of the vision encoder, in two forms.

* ``varlen``: :func:`devgraph.reference.kernels.attention_backend` ``.varlen_attention`` reads the image
  boundaries (``cu_seqlens``) from a device tensor, so a ``full`` graph captured once for a token count
  replays correctly for every split of that count into images.
* ``sdpa``: a ``graph_break`` op that runs PyTorch's SDPA once per image, sized by host-side boundaries
  from the forward context (``context.cu_seqlens``, or ``context.cu_window_seqlens`` for a windowed block,
  each a list), as engines feed flash-attention's varlen API.
  ``breakable`` and ``tc_piecewise`` run it eagerly between graph segments with the live context. Without
  host boundaries (``full`` captures it whole with no context) it uses the device-metadata reference.
"""

# No ``from __future__ import annotations`` here: torch derives the operator schema from the annotations.

import torch
import torch.nn.functional as F

from devgraph import get_forward_context, graph_break
from devgraph.reference.kernels import attention_backend, torch_ref
from devgraph.reference.kernels.interface import attention_fake

__all__ = ["IMAGE_ATTENTION_OP_NAME", "image_sdpa", "varlen_image_attention"]

IMAGE_ATTENTION_OP_NAME = "devgraph_ref::image_sdpa"


def varlen_image_attention(
    kernels: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Non-causal attention within each image of a packed ``[S, H, D]`` batch (device ``cu_seqlens``)."""
    return attention_backend(kernels).varlen_attention(q, k, v, cu_seqlens, scale)


def _host_boundaries(windowed: bool) -> list | None:
    context = get_forward_context()
    name = "cu_window_seqlens" if windowed else "cu_seqlens"
    value = getattr(context, name, None) if context is not None else None
    return value if isinstance(value, list) else None


@graph_break(IMAGE_ATTENTION_OP_NAME, fake=attention_fake)
def image_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, windowed: bool
) -> torch.Tensor:
    """The ``sdpa`` attention break op: SDPA over each segment's tokens, from the context's host boundaries
    (``cu_seqlens``: images; ``cu_window_seqlens`` when ``windowed``: windows).

    Rows past the last segment (padding tokens) are zero, as in the varlen kernels.
    """
    host = _host_boundaries(windowed)
    if host is None:
        return torch_ref.varlen_attention(q, k, v, cu_seqlens, scale)
    out = torch.zeros_like(q)
    for start, stop in zip(host[:-1], host[1:], strict=False):
        if stop <= start:
            continue
        # [L, H, D] -> [H, L, D]: each image is one SDPA call with no mask (non-causal).
        attn = F.scaled_dot_product_attention(
            q[start:stop].transpose(0, 1),
            k[start:stop].transpose(0, 1),
            v[start:stop].transpose(0, 1),
            scale=scale,
        )
        out[start:stop] = attn.transpose(0, 1)
    return out
