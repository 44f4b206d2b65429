"""The ROCm platform: HIP graphs on AMD GPUs, through ``torch.cuda`` on a ROCm build of torch.

ROCm builds of torch expose AMD GPUs as device type ``cuda`` and HIP graphs through the same
``torch.cuda.CUDAGraph`` API, so this platform is
:class:`~devgraph.platforms.torch_cuda.TorchCudaGraphPlatform` with ROCm detection (``torch.version.hip``)
and ROCm-specific advice.

Test hook: with ``DEVGRAPH_ROCM_ON_CUDA=1`` the platform also accepts a CUDA build on an NVIDIA GPU, so the
conformance kit can run the HIP backend classes where torch's graph API is the same. Only the kit's
documented GPU command sets it; it never changes what a ROCm machine does.
"""

from __future__ import annotations

import os
import re
from typing import ClassVar

import torch

from devgraph import Availability, CaptureError
from devgraph.messages import HOST_SYNC, HOST_SYNC_ADVICE
from devgraph.platforms.torch_cuda import TorchCudaGraphPlatform

__all__ = ["RocmPlatform", "ROCM_ON_CUDA_ENV", "rocm_on_cuda"]

#: Test hook: run the HIP backend classes on an NVIDIA GPU (see the module docstring).
ROCM_ON_CUDA_ENV = "DEVGRAPH_ROCM_ON_CUDA"

_HIPBLAS = re.compile(r"hipblas(lt)?|rocblas", re.IGNORECASE)
_CAPTURE_UNSUPPORTED = re.compile(
    r"hipErrorStreamCaptureUnsupported|hipErrorStreamCaptureInvalidated"
    r"|operation not permitted when stream is capturing|stream is capturing",
    re.IGNORECASE,
)


def rocm_on_cuda() -> bool:
    """Whether the ``DEVGRAPH_ROCM_ON_CUDA=1`` test hook is set."""
    return os.environ.get(ROCM_ON_CUDA_ENV, "") == "1"


def _is_hip() -> bool:
    return bool(getattr(torch.version, "hip", None))


class RocmPlatform(TorchCudaGraphPlatform):
    """HIP graphs on AMD GPUs (a ROCm build of torch; devices are ``cuda:N``)."""

    name: ClassVar[str] = "rocm"
    # Below CUDA's 100: on a ROCm build CUDA is unusable anyway; with the test hook on an NVIDIA GPU,
    # CUDA stays the platform that "auto" picks.
    priority: ClassVar[int] = 99

    def availability(self) -> Availability:
        if not _is_hip():
            if rocm_on_cuda():
                if torch.cuda.is_available():
                    return Availability(
                        True, f"test hook {ROCM_ON_CUDA_ENV}=1: HIP backend classes on a CUDA GPU"
                    )
                return Availability(False, f"{ROCM_ON_CUDA_ENV}=1 is set but no CUDA GPU is visible")
            return Availability(
                False,
                f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None); on "
                "AMD GPUs install a ROCm build of torch (pip install torch --index-url "
                "https://download.pytorch.org/whl/rocm6.3)",
            )
        if not torch.cuda.is_available():
            return Availability(
                False,
                "no AMD GPU is visible (torch.cuda.is_available() is False): check rocm-smi, the amdgpu "
                "driver, and HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES",
            )
        return Availability(True)

    def matches(self, device: torch.device) -> bool:
        return device.type == "cuda" and (_is_hip() or rocm_on_cuda())

    def describe(self) -> str:
        if not self.availability():
            return self.name
        if not _is_hip():
            return (
                f"{torch.cuda.get_device_name()} (HIP backend classes on CUDA {torch.version.cuda} "
                f"through the {ROCM_ON_CUDA_ENV} test hook, torch {torch.__version__})"
            )
        return f"{torch.cuda.get_device_name()} (HIP {torch.version.hip}, torch {torch.__version__})"

    def translate_capture_error(self, error: BaseException, size: int | None) -> CaptureError | None:
        text = str(error)
        first = next((line.strip() for line in text.splitlines() if line.strip()), text)
        if _HIPBLAS.search(text) and _CAPTURE_UNSUPPORTED.search(text):
            return CaptureError(
                f"hipBLAS/hipBLASLt tried to create a handle or workspace while capturing ({first[:160]}). "
                "hipBLASLt creates its handles lazily, per stream: warm the forward up on the capture stream "
                "before capturing (GraphRunner does; a custom driver must too) and keep capture on that "
                "stream",
                size=size,
            )
        if _CAPTURE_UNSUPPORTED.search(text):
            return CaptureError(
                f"{HOST_SYNC} of HIP during capture ({first[:160]}); {HOST_SYNC_ADVICE} (run with "
                "tc_piecewise on ROCm)",
                size=size,
            )
        return super().translate_capture_error(error, size)
