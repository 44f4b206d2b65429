"""devgraph plug-in for NVIDIA GPUs (CUDA graphs through ``torch.cuda``)."""

from devgraph_cuda.platform import CudaPlatform

__all__ = ["CudaPlatform"]
