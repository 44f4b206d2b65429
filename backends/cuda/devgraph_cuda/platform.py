"""The CUDA platform: NVIDIA GPUs on a CUDA build of torch."""

from __future__ import annotations

import torch

from devgraph import Availability, CaptureError
from devgraph.messages import HOST_SYNC, HOST_SYNC_ADVICE
from devgraph.platforms.torch_cuda import TorchCudaGraphPlatform

__all__ = ["CudaPlatform"]

# CUDA runtime messages that mean "something in the captured region is not capturable", and what to do.
_CAPTURE_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        (
            "operation not permitted when stream is capturing",
            "cudaErrorStreamCaptureUnsupported",
            "during CUDA graph capture",
        ),
        f"{HOST_SYNC} during capture",
    ),
    (
        (
            "operation would make the legacy stream depend on a capturing blocking stream",
            "cudaErrorStreamCaptureImplicit",
        ),
        "an op used the legacy default stream during capture (torch.cuda.synchronize(), a blocking copy, "
        "or a library that launches on stream 0)",
    ),
    (
        ("operation failed due to a previous error during capture", "cudaErrorStreamCaptureInvalidated"),
        "the capture was invalidated by an earlier non-capturable call in the captured region",
    ),
    (
        (
            "capture sequence was not initiated in this thread",
            "cudaErrorStreamCaptureWrongThread",
            "cudaErrorStreamCaptureUnjoined",
            "captured event was not recorded in this capture",
        ),
        "work was forked onto another stream or thread during capture and not joined back",
    ),
)
_ADVICE = (
    f"{HOST_SYNC_ADVICE} (modes 'breakable' / 'tc_piecewise' run it eagerly between graph segments); "
    "torch.cuda.synchronize() and blocking copies sync with the host too"
)


class CudaPlatform(TorchCudaGraphPlatform):
    """CUDA graphs on NVIDIA GPUs."""

    name = "cuda"
    priority = 100
    # One warm-up per key suffices, zero does not: measured on an H100 (torch 2.11), the first capture of a
    # fresh process fails with 0 warm-ups (cuBLAS creates its handle inside the capture) and succeeds, with
    # outputs equal to eager, with 1, for full, breakable and tc_piecewise
    # (benchmarks/results/h100-decode-partial.json, "warmups").
    warmup_iters = 1

    def availability(self) -> Availability:
        if getattr(torch.version, "hip", None):
            return Availability(False, "this torch is a ROCm build; AMD GPUs are handled by devgraph-rocm")
        if torch.version.cuda is None:
            return Availability(
                False,
                f"torch {torch.__version__} was built without CUDA; install a CUDA build of "
                "torch (pip install torch --index-url https://download.pytorch.org/whl/cu126)",
            )
        if not torch.cuda.is_available():
            return Availability(
                False,
                "no NVIDIA GPU is visible (torch.cuda.is_available() is False); check the "
                "driver with nvidia-smi and CUDA_VISIBLE_DEVICES",
            )
        return Availability(True)

    def matches(self, device: torch.device) -> bool:
        return device.type == "cuda" and not getattr(torch.version, "hip", None)

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        """A CUDA stream-capture error as a :class:`CaptureError` saying what broke the rules and the fix."""
        # cuBLAS creating its handle inside the capture (no warm-up) is diagnosed by the core's advice
        # table for every platform (devgraph/advice.py), so it is not repeated here.
        text = str(error)
        for needles, what in _CAPTURE_RULES:
            if any(needle in text for needle in needles):
                first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
                return CaptureError(f"{what} ({first_line}); {_ADVICE}", size=size)
        return super().translate_capture_error(error, size)

    def describe(self) -> str:
        if not self.availability():
            return "cuda"
        free, total = self.mem_get_info()
        return (
            f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, torch {torch.__version__}, "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"
        )
