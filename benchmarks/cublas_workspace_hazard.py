"""Shows why CUDA graphs captured earlier break once torch.compile(mode="reduce-overhead") records.

CUDA graph trees (what ``mode="reduce-overhead"`` uses) call ``torch._C._cuda_clearCublasWorkspaces()``
around every warm-up and recording. A graph captured before that (hand-written or devgraph) baked in the
address of the cuBLAS workspace of its capture stream; once the workspace is freed, the allocator hands
that memory to the next tensor and every replay of the old graph writes cuBLAS scratch data into it.

    python benchmarks/cublas_workspace_hazard.py      # on an NVIDIA GPU; prints one JSON line
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU")
        return 1
    torch.manual_seed(0)
    # A skinny bf16 GEMM with a long reduction: cuBLAS(Lt) picks split-K kernels that use the workspace.
    a = torch.randn(16, 65536, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(65536, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            a @ b  # warm-up on the capture stream allocates its cuBLAS workspace (regular pool)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = a @ b
    graph.replay()
    torch.cuda.synchronize()
    expected = out.clone()

    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()  # what CUDA graph trees do when they warm up or record
    freed = before - torch.cuda.memory_allocated()
    # Hand the freed memory to new tensors, as the next allocations on that stream would (the caching
    # allocator reuses a block on the stream it was allocated on), and fill them with a pattern.
    with torch.cuda.stream(stream):
        victims = [torch.full((max(freed, 1 << 20),), 7, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    clobbered = sum(int((v != 7).sum().item()) for v in victims)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "workspace_bytes_freed_by_clear": freed,
        "victim_bytes_overwritten_by_old_graph_replay": clobbered,
        "old_graph_output_still_correct": bool(torch.equal(out, expected)),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
