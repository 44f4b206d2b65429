"""How the fast path reaches into a model: dispatchers that run a compiled region inside a decode step and
HF's own code everywhere else, installed once however many decoders share them, removed with the last."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

__all__ = ["active_regions", "packed_attention", "patch_forward", "rope_dispatch", "share_patch"]

#: The regions of the decode step running now (set by the decoder around each decode forward): every
#: dispatcher runs HF's own function whenever it is ``None``, so prefill and other models are untouched.
active_regions: ContextVar[Any] = ContextVar("devgraph_hf_decode_regions", default=None)


def rope_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    """A modeling module's ``apply_rotary_pos_emb``: the rope region in decode steps, HF's otherwise."""

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        regions = active_regions.get()
        if regions is None or regions.rope is None or len(args) != 4 or set(kwargs) - {"unsqueeze_dim"}:
            return original(*args, **kwargs)
        return regions.rope(*args, *kwargs.values())

    return dispatch


def packed_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    """HF's sdpa attention, except in decode steps with grouped query heads: attention on the packed query."""

    def attention(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any
    ):
        regions = active_regions.get()
        groups = query.shape[1] // key.shape[1]
        if (
            regions is None
            or not regions.fast.pack_gqa
            or query.shape[2] != 1
            or groups == 1
            or not isinstance(mask, torch.Tensor)  # decode on a static cache always has a mask
            or mask.dim() != 4
            or mask.shape[1] != 1  # one mask for every head, so it broadcasts over the packed heads
            or kw.get("position_bias") is not None
            or kw.get("softcap") is not None
        ):
            return original(module, query, key, value, mask, **kw)
        batch, heads, _, dim = query.shape
        packed = query.reshape(batch, key.shape[1], groups, dim)  # a [b, 1, 1, kv] mask broadcasts
        out = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=mask, scale=kw.get("scaling")
        )
        return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None

    return attention


#: Users of each shared dispatcher (keyed by the dispatcher's id): the original comes back with the last.
_patch_users: dict[int, int] = {}


def share_patch(
    get: Callable[[], Any],
    put: Callable[[Any], None],
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    restore: Callable[[Any], None] | None = None,
) -> Callable[[], None]:
    """Install ``make(original)`` where ``get()`` finds ``original`` (once for every decoder: later ones
    share the dispatcher, which reads the active decode step); returns the release function."""
    current = get()
    if getattr(current, "_devgraph_original", None) is None:
        dispatch = make(current)
        dispatch._devgraph_original = current  # type: ignore[attr-defined]
        # How to undo, decided by the first installer (a later one would see the dispatcher in place).
        dispatch._devgraph_restore = restore or put  # type: ignore[attr-defined]
        put(dispatch)
        current = dispatch
    _patch_users[id(current)] = _patch_users.get(id(current), 0) + 1
    installed = current

    def release() -> None:
        _patch_users[id(installed)] -= 1
        if _patch_users[id(installed)] == 0:
            del _patch_users[id(installed)]
            if get() is installed:
                installed._devgraph_restore(installed._devgraph_original)

    return release


def patch_forward(module: Any, role: str) -> Callable[[], None]:
    """Route ``module.forward`` through the region in decode steps; returns the release function."""
    own = vars(module).get("forward")  # an instance-level forward someone else set (hooks): keep it

    def restore(original: Any) -> None:
        if own is None:
            delattr(module, "forward")
        else:
            module.forward = own

    return share_patch(
        lambda: module.forward,
        lambda fn: setattr(module, "forward", fn),
        lambda original: _patched_forward(module, role, original),
        restore,
    )


def _patched_forward(module: Any, role: str, eager: Callable[..., Any]) -> Callable[..., Any]:
    if role == "rms_norm":

        def norm_forward(x: torch.Tensor) -> torch.Tensor:
            regions = active_regions.get()
            if regions is None or regions.norm is None:
                return eager(x)
            return regions.norm(x, module.weight, module.variance_epsilon)

        return norm_forward

    def mlp_forward(x: torch.Tensor) -> torch.Tensor:
        regions = active_regions.get()
        if regions is None or regions.mlp is None:
            return eager(x)
        return regions.mlp(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)

    return mlp_forward
