"""The CUDA platform: NVIDIA GPUs on a CUDA build of torch."""

from __future__ import annotations

import torch

from devgraph.platform import Availability
from devgraph.torch_cuda_api import TorchCudaGraphPlatform

__all__ = ["CudaPlatform"]


class CudaPlatform(TorchCudaGraphPlatform):
    """CUDA graphs on NVIDIA GPUs."""

    name = "cuda"
    priority = 100

    def availability(self) -> Availability:
        if getattr(torch.version, "hip", None):
            return Availability(False, "this torch is a ROCm build; AMD GPUs are handled by devgraph-rocm")
        if torch.version.cuda is None:
            return Availability(False, f"torch {torch.__version__} was built without CUDA; install a CUDA build of "
                                       "torch (pip install torch --index-url https://download.pytorch.org/whl/cu126)")
        if not torch.cuda.is_available():
            return Availability(False, "no NVIDIA GPU is visible (torch.cuda.is_available() is False); check the "
                                       "driver with nvidia-smi and CUDA_VISIBLE_DEVICES")
        return Availability(True)

    def matches(self, device: torch.device) -> bool:
        return device.type == "cuda" and not getattr(torch.version, "hip", None)

    def describe(self) -> str:
        if not self.availability():
            return "cuda"
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, torch {torch.__version__})"
