"""``StaticInput``: how one per-step input is kept in a static buffer the graphs read.

Part of the contract: it imports torch, devgraph's errors and message helpers, and the axis name
``TOKENS`` from :mod:`devgraph.contract.keys`, so backends, the runner and engines can all name it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from devgraph.contract.keys import TOKENS
from devgraph.errors import ConfigError
from devgraph.messages import shorten

__all__ = ["StaticInput", "Fill", "EDGE"]

#: ``fill="edge"`` repeats the last real row into the padding rows (``cu_seqlens``: padded requests
#: then have zero length).
EDGE = "edge"
Fill = int | float | bool | Literal["edge"]


@dataclass(frozen=True)
class StaticInput:
    """A per-step input kept in a static buffer of ``(rows, *shape)``.

    * ``dtype`` / ``shape``: the element type and the shape of one row.
    * ``fill``: written into padding rows. Choose a harmless value (token 0, a scratch KV slot, length 0);
      ``"edge"`` repeats the last real row (for cumulative lengths). It must be exactly representable in
      ``dtype``: ``-1`` for ``uint8``, ``1.5`` for ``int64`` or ``2`` for ``bool`` is refused, not wrapped,
      truncated or cast (floats may round, but not overflow).
    * ``host``: keep the buffer in host memory (values break ops or host-side graph updates read).
    * ``axis``: which count the rows follow: ``tokens`` (the phase's size, the default), ``requests``, or
      an engine-defined axis name. Each axis is padded to its own bucket.
    * ``extra_rows``: rows beyond the axis count (``cu_seqlens`` has ``requests + 1``).
    """

    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    fill: Fill = 0
    host: bool = False
    axis: str = TOKENS
    extra_rows: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"StaticInput dtype must be a torch.dtype, got {shorten(self.dtype)}")
        shape = self.shape
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list, torch.Size)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ConfigError(
                f"StaticInput shape must be a tuple of non-negative ints (the shape of one row), "
                f"got {shorten(self.shape)}"
            )
        object.__setattr__(self, "shape", tuple(shape))
        if not isinstance(self.host, bool):
            raise ConfigError(f"StaticInput host must be True or False, got {shorten(self.host)}")
        if not isinstance(self.axis, str) or not self.axis.isidentifier():
            raise ConfigError(
                f"StaticInput axis must be a name such as 'tokens' or 'requests', got {shorten(self.axis)}"
            )
        if isinstance(self.extra_rows, bool) or not isinstance(self.extra_rows, int) or self.extra_rows < 0:
            raise ConfigError(f"StaticInput extra_rows must be an int >= 0, got {shorten(self.extra_rows)}")
        _check_fill(self.fill, self.dtype)

    def rows(self, count: int) -> int:
        """Buffer rows for ``count`` entries of this input's axis."""
        return count + self.extra_rows

    def describe(self, name: str) -> str:
        dims = ", ".join(["n" if self.axis == TOKENS else self.axis, *map(str, self.shape)])
        extra = f" + {self.extra_rows}" if self.extra_rows else ""
        where = "host" if self.host else "device"
        return f"{name}: {self.dtype} ({dims}{extra}) on the {where}, fill {self.fill!r}"


def _check_fill(fill: object, dtype: torch.dtype) -> None:
    """``fill`` must be storable in ``dtype`` without changing its value."""
    if fill == EDGE and isinstance(fill, str):
        return
    if not isinstance(fill, (int, float, bool)):
        raise ConfigError(
            f"StaticInput fill must be a number, a bool or 'edge', "
            f"got {shorten(fill)} ({type(fill).__name__})"
        )
    if dtype == torch.bool:
        if fill not in (0, 1) or isinstance(fill, float) and fill not in (0.0, 1.0):
            raise ConfigError(
                f"StaticInput fill {fill!r} does not fit dtype torch.bool (use True, False, 0 or 1)"
            )
        return
    if dtype.is_floating_point or dtype.is_complex:
        try:
            value = float(fill)
        except OverflowError:  # an int too large for any float
            raise ConfigError(f"StaticInput fill {shorten(fill)} overflows {dtype}") from None
        if math.isnan(value) or math.isinf(value):
            return  # NaN and infinities are representable; the caller asked for them
        # Rounding to the dtype is expected for floats; overflowing (to infinity, or saturating to the
        # largest finite value, as float8 does) is not.
        largest = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
        stored = torch.tensor(value, dtype=torch.float64).to(dtype).to(torch.float64).item()
        if abs(value) > largest or (math.isinf(stored) and not math.isinf(value)):
            raise ConfigError(f"StaticInput fill {fill!r} overflows {dtype} (largest finite: {largest:g})")
        return
    if isinstance(fill, float) and not fill.is_integer():
        raise ConfigError(f"StaticInput fill {fill!r} is not an integer but the dtype is {dtype}")
    info = torch.iinfo(dtype)
    if not info.min <= int(fill) <= info.max:  # an int of any size compares exactly
        raise ConfigError(
            f"StaticInput fill {shorten(fill)} is outside {dtype}'s range [{info.min}, {info.max}]; "
            "it would wrap around to another value"
        )
