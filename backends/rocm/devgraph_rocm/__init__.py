"""devgraph plug-in for AMD GPUs: HIP graphs through torch.cuda on ROCm builds of torch."""

from devgraph_rocm.platform import ROCM_ON_CUDA_ENV, RocmPlatform

__all__ = ["ROCM_ON_CUDA_ENV", "RocmPlatform"]
