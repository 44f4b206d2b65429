"""The opt-in fast path: changes that apply only inside captured decode steps, and are undone on close.

* **Compiled regions.** Each RMSNorm, the SwiGLU MLP and RoPE run as ``torch.compile``'d pure tensor
  functions that take the weights as arguments (one compile per function and input rank serves every
  layer and every batch size: the batch dimension is dynamic). Compiling a whole HF decoder layer would
  recompile per layer (dynamo guards ``self_attn.layer_idx``, which picks the cache layer). A region is
  installed only where the model's own code computes the same function (checked numerically once per
  class), on this model's module instances (RMSNorm, MLP) and on the modeling module's
  ``apply_rotary_pos_emb`` (a dispatcher that runs HF's function outside decode steps).
* **Packed GQA.** Decode attention on the key/value heads: the query's heads are grouped per key/value head
  (``[b, kv_heads, groups, d]``) instead of copying keys and values to every query head (``repeat_kv``,
  two copies of the whole cache view per layer and step in transformers 5.17; 5.2x packs by itself in
  eager decode). ``sdpa`` attention only.
* **Windows** (:class:`FastPath` ``windows=``) are applied by the decoder: a graph per window reads only
  the first ``w`` cache positions.

Compiled kernels round differently from HF's eager ones: tokens are close to, not bitwise equal to, HF
eager ``generate()`` (as for HF's own compiled ``generate()``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph import ConfigError, GraphPlatform
from devgraph.integrations.hf.lib import transformers
from devgraph.integrations.hf.patching import (
    active_regions,
    packed_attention,
    patch_forward,
    rope_dispatch,
    share_patch,
)
from devgraph.integrations.hf.regions import (
    CompiledRegion,
    close_enough,
    matches,
    region_role,
    rms_norm,
    rope,
    swiglu,
)
from devgraph.messages import shorten

__all__ = ["MIN_WINDOW", "FastPath", "DecodeRegions", "resolve_windows"]

COMPILERS = ("inductor", "eager")
#: The shortest window :class:`FastPath` accepts (a runner's ``warmup_iters`` is at most 16).
MIN_WINDOW = 16


@dataclass(frozen=True)
class FastPath:
    """What ``DevgraphDecoder(fast=FastPath(...))`` changes inside decode steps (``fast=True``: defaults).

    ``compile_regions``: RMSNorm, SwiGLU and RoPE compiled (``compiler``: ``"inductor"``, or ``"eager"``
    to trace with dynamo and run the traced ops as they are, for debugging). ``pack_gqa``: decode attention
    on the key/value heads (``sdpa`` only). ``windows``: ``None`` (attend over all ``max_cache_len``
    positions), ``"auto"`` (powers of two from 256, then ``max_cache_len``) or window lengths (at least
    :data:`MIN_WINDOW`): each step replays the graph of the smallest window holding the sequence, so
    attention reads only that window.
    """

    compile_regions: bool = True
    pack_gqa: bool = True
    windows: Sequence[int] | str | None = None
    compiler: str = "inductor"

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ConfigError(f"FastPath compiler must be one of {COMPILERS}, got {shorten(self.compiler)}")
        windows = self.windows
        if windows is None or windows == "auto":
            return
        if (
            isinstance(windows, str)
            or not isinstance(windows, Sequence)
            or not windows
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in windows)
        ):
            raise ConfigError(
                f"FastPath windows must be None, 'auto' or a non-empty list of ints, got {shorten(windows)}"
            )
        short = sorted(w for w in windows if isinstance(w, int) and w < MIN_WINDOW)
        if short:
            raise ConfigError(
                f"FastPath windows must be at least {MIN_WINDOW} positions, got {shorten(short)}: a shorter "
                "window saves nothing, and each captured graph's warm-up steps write into it"
            )


def resolve_windows(windows: Sequence[int] | str | None, max_cache_len: int) -> tuple[int, ...]:
    """Window lengths, ascending, ending at ``max_cache_len`` (``()``: no windows)."""
    if windows is None:
        return ()
    if windows == "auto":
        chosen = [w for w in (256 << i for i in range(16)) if w < max_cache_len]
    elif isinstance(windows, str) or not all(isinstance(w, int) and not isinstance(w, bool) for w in windows):
        raise ConfigError(f"FastPath windows must be None, 'auto' or a list of ints, got {shorten(windows)}")
    else:
        chosen = list(windows)
    bad = [w for w in chosen if not MIN_WINDOW <= w <= max_cache_len]
    if bad:
        raise ConfigError(
            f"FastPath windows {shorten(bad)} must lie in {MIN_WINDOW}..max_cache_len ({max_cache_len})"
        )
    return tuple(sorted({*chosen, max_cache_len}))


class DecodeRegions:
    """The fast path installed on one model; :meth:`uninstall` undoes every change."""

    def __init__(self, model: Any, fast: FastPath, platform: GraphPlatform) -> None:
        self.model = model
        self.fast = fast
        self._undo: list[Callable[[], None]] = []
        self.norm: CompiledRegion | None = None
        self.mlp: CompiledRegion | None = None
        self.rope: CompiledRegion | None = None
        self.skipped: list[str] = []
        self._config = model.config.get_text_config(decoder=True)
        heads = self._config.num_attention_heads
        self._groups = heads // (getattr(self._config, "num_key_value_heads", None) or heads)
        if fast.compile_regions:
            self.norm = CompiledRegion(rms_norm, fast.compiler, platform, 1)
            self.mlp = CompiledRegion(swiglu, fast.compiler, platform, 1)
            self.rope = CompiledRegion(rope, fast.compiler, platform, 4)

    # -- install ----------------------------------------------------------------------------------------
    def install(self) -> None:
        """Patch the model (and the shared dispatchers); on failure undo what was done and re-raise."""
        try:
            if self.fast.compile_regions:
                self._install_modules()
                self._install_rope()
            if self.fast.pack_gqa:
                self._install_attention(self._config)
        except BaseException:
            self.uninstall()
            raise

    def _install_modules(self) -> None:
        checked: dict[type, bool] = {}
        for module in self.model.modules():
            kind = type(module)
            role = region_role(module)
            if role is None:
                continue
            if kind not in checked:
                checked[kind] = matches(module, role)
                if not checked[kind]:
                    self.skipped.append(f"{kind.__name__} (its forward differs from the {role} region)")
            if checked[kind]:
                self._undo.append(patch_forward(module, role))

    def _install_rope(self) -> None:
        # The attention classes call their modeling module's global apply_rotary_pos_emb.
        attentions = [type(m) for m in self.model.modules() if type(m).__name__.endswith("Attention")]
        owners = {sys.modules[kind.__module__] for kind in attentions} or {
            sys.modules[type(self.model).__module__]
        }
        for owner in sorted(owners, key=lambda module: module.__name__):
            self._install_rope_in(owner)

    def _install_rope_in(self, owner: Any) -> None:
        current = getattr(owner, "apply_rotary_pos_emb", None)
        if current is None:
            self.skipped.append(f"{owner.__name__}.apply_rotary_pos_emb (not found: RoPE stays HF's)")
            return
        original = getattr(current, "_devgraph_original", current)
        q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8)
        cos, sin = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
        try:
            same = all(
                close_enough(a, b)
                for a, b in zip(original(q, k, cos, sin), rope(q, k, cos, sin), strict=True)
            )
        except Exception:
            same = False
        if not same:
            self.skipped.append(f"{owner.__name__}.apply_rotary_pos_emb (differs from the rope region)")
            return

        self._undo.append(
            share_patch(
                lambda: getattr(owner, "apply_rotary_pos_emb"),  # noqa: B009
                lambda fn: setattr(owner, "apply_rotary_pos_emb", fn),  # noqa: B010
                rope_dispatch,
            )
        )

    def _install_attention(self, config: Any) -> None:
        if config._attn_implementation != "sdpa" or self._groups == 1:
            return
        functions: Any = getattr(transformers().modeling_utils, "ALL_ATTENTION_FUNCTIONS", None)
        if not isinstance(getattr(functions, "_local_mapping", None), dict):
            # Without the registry's local layer its original could not be put back: decode unpacked.
            self.skipped.append(
                "packed GQA (this transformers has no ALL_ATTENTION_FUNCTIONS._local_mapping)"
            )
            return
        had_local = "sdpa" in functions._local_mapping

        def restore(original: Callable[..., Any]) -> None:
            if had_local:
                functions["sdpa"] = original
            else:
                del functions["sdpa"]

        self._undo.append(
            share_patch(
                lambda: functions["sdpa"],
                lambda fn: functions.__setitem__("sdpa", fn),
                packed_attention,
                restore,
            )
        )

    # -- use --------------------------------------------------------------------------------------------
    def activate(self) -> Any:
        """Mark a decode step as running (returns the token for :meth:`deactivate`)."""
        return active_regions.set(self)

    @staticmethod
    def deactivate(token: Any) -> None:
        active_regions.reset(token)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def describe(self) -> dict[str, Any]:
        compiled = [c for c in (self.norm, self.mlp, self.rope) if c is not None]
        return {
            "compile_regions": self.fast.compile_regions,
            "pack_gqa": self.fast.pack_gqa and self._groups > 1,
            "compiler": self.fast.compiler,
            "frames_compiled": sum(c.frames for c in compiled),
            "per_shape_regions": [c.describe() for c in compiled if c.describe()["compile"] != "dynamic"],
            "installed": len(self._undo),
            "skipped": list(self.skipped),
        }
