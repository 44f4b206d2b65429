"""The pure tensor functions the fast path compiles, how one is compiled, and how a module is checked
against one before its forward is routed through it."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from devgraph import GraphPlatform
from devgraph.strategies.adaptive import AdaptiveCompile
from devgraph.strategies.compiling import inductor_compile

__all__ = ["CompiledRegion", "close_enough", "matches", "region_role", "rms_norm", "rope", "swiglu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    linear = torch.nn.functional.linear
    return linear(torch.nn.functional.silu(linear(x, gate)) * linear(x, up), down)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class CompiledRegion:
    """``fn`` compiled once with dim 0 of its first ``dynamic_args`` arguments dynamic (size 1 included),
    on a code object of its own (dynamo's cache entries and recompile limit are per code object); compiled
    per shape with static shapes where dynamo cannot trace it dynamically (:class:`AdaptiveCompile`)."""

    def __init__(self, fn: Callable[..., Any], compiler: str, platform: GraphPlatform, dynamic_args: int):
        fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        self.frames = 0
        self._compiler = compiler
        self._platform = platform
        self._fn = AdaptiveCompile(
            fresh, self._backend, f"fast path region {fn.__name__}", dynamic_args=dynamic_args
        )

    def _backend(self, gm: torch.fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
        self.frames += 1
        return gm if self._compiler == "eager" else inductor_compile(gm, example, None)

    def describe(self) -> dict[str, Any]:
        return self._fn.describe()

    def __call__(self, *args: Any) -> Any:
        # Under the CPU simulator's capture the call is recorded whole (dynamo cannot trace under its
        # dispatch mode); on a device this just calls it and the capture records its kernels.
        return self._platform.record_opaque(self._fn, *args)


def close_enough(eager: Any, fast: Any) -> bool:
    return (
        isinstance(eager, torch.Tensor)
        and eager.shape == fast.shape
        and torch.allclose(eager, fast, 1e-3, 1e-3)
    )


def region_role(module: Any) -> str | None:
    name = type(module).__name__
    if name.endswith("RMSNorm") and hasattr(module, "weight") and hasattr(module, "variance_epsilon"):
        return "rms_norm"
    projections = ("gate_proj", "up_proj", "down_proj")
    if name.endswith("MLP") and all(
        getattr(getattr(module, p, None), "bias", 0) is None for p in projections
    ):
        return "swiglu"
    return None


def matches(module: Any, role: str) -> bool:
    """Whether the module's own forward computes the region's function (one small random input)."""
    weight = module.weight if role == "rms_norm" else module.gate_proj.weight
    width = weight.shape[0] if role == "rms_norm" else weight.shape[1]
    x = torch.randn(2, 1, width, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        try:
            eager = module.forward(x)
        except Exception:
            return False
        if role == "rms_norm":
            return close_enough(eager, rms_norm(x, module.weight, module.variance_epsilon))
        return close_enough(
            eager, swiglu(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)
        )
