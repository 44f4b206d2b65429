"""Launching a reference Triton kernel, or only building it (no triton import here).

Every launch of the reference kernels (:mod:`triton_fused`, :mod:`triton_ops`, :mod:`triton_linear`,
:mod:`triton_argmax`; not the tensor-parallel all-reduce, which needs its peers) goes through
:func:`launch`. Inside :func:`build_only` (per thread) a launch builds its kernel instead: Triton
compiles it, or loads it from its cache, for exactly the arguments the launch would have passed, and
nothing runs. The wrappers then take ``meta`` tensors, which carry what a kernel is specialised on (dtype,
shape, strides, the 16-byte alignment of a view's offset) and hold no memory: a thread can build the
kernels of a step it will never run, while another thread loads weights or captures a graph
(:mod:`devgraph.reference.kernel_builds`). Building only from the wrappers' own argument code is what
keeps a build and the later launch the same kernel; a build from hand-written arguments can miss it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["build_only", "building", "launch", "on_device"]

_THREAD = threading.local()


@contextlib.contextmanager
def build_only() -> Iterator[None]:
    """On this thread, until the block ends: every launch builds its kernel and runs nothing."""
    before = getattr(_THREAD, "building", False)
    _THREAD.building = True
    try:
        yield
    finally:
        _THREAD.building = before


def building() -> bool:
    """Whether this thread is inside :func:`build_only`."""
    return getattr(_THREAD, "building", False)


def on_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may go to a kernel: on a GPU, or a ``meta`` stand-in while building."""
    return tensor.device.type == "cuda" or (tensor.device.type == "meta" and building())


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
    """``kernel[grid](*args, **options)``, or inside :func:`build_only` the kernel built for those
    arguments (and Triton's launcher for it: a small C module compiled once per signature on some Triton
    versions) without a launch."""
    if not building():
        kernel[grid](*args, **options)
        return
    compiled = kernel.warmup(*args, grid=grid, **options)
    _build_launcher(compiled)


def _build_launcher(compiled: Any) -> None:
    """Build the host-side launcher a first launch would (Triton 3.6 compiles it with the C compiler, a
    fifth of a second each on a cold cache), without loading the kernel onto the device: a module load
    while another thread captures a graph is an error. Newer Triton launches without a per-signature
    module, which makes this cheap; a Triton without these names leaves it to the first launch."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # an optimisation only: the first launch builds it as before
        return
