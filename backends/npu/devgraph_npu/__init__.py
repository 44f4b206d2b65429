"""devgraph plug-in for Ascend NPUs: NPU graphs through torch-npu, imported only when used."""

from devgraph_npu.platform import NpuPlatform

__all__ = ["NpuPlatform"]
