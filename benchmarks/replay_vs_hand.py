"""devgraph's ``full`` graph against a hand-written ``torch.cuda.CUDAGraph`` of the same forward, taken apart:
the two graphs' replays alone, each with the runner's five input copies in front (``copy_`` per input, and
one ``torch._foreach_copy_``), and ``runner.run()`` whole. Qwen3-0.6B's reference decoder at batch 1 with
cuBLAS projections, milliseconds per step over 20 steps back to back (median of seven); prints only.

    python3 benchmarks/replay_vs_hand.py
"""

import statistics

import torch

from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner, make_decode_batch
from devgraph.reference.kernels import triton_linear

triton_linear.config_for = lambda r, n, k: None  # cuBLAS projections, as the hand-written graph
m = ReferenceModel(
    ReferenceConfig.preset("qwen3-0.6b", max_seq_len=512, max_requests=64), device="cuda", seed=0
)
r = decode_runner(m, mode="full", sizes=[1], progress=False)
r.capture()
batch = make_decode_batch(m, 1, seq_lens=256, seed=1)
r.run(**batch)
backend = r.life.sets.all[0].backend
key = next(iter(backend._entries))
entry = backend._entries[key]
bufs = r._steps.buffers
hand = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    m.decode_step(**batch)
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(hand):
    m.decode_step(**batch)
static = dict(bufs.buffers)
names = list(batch)
print("inputs", {n: (tuple(batch[n].shape), batch[n].dtype, tuple(static[n].shape)) for n in names})


def copies_memcpy():
    for n in names:
        static[n][: batch[n].shape[0]].copy_(batch[n])


dsts = [static[n][: batch[n].shape[0]] for n in names]
srcs = [batch[n] for n in names]


def copies_foreach():
    torch._foreach_copy_(dsts, srcs)


variants = {
    "hand replay": hand.replay,
    "devgraph graph replay only": entry.graph.replay,
    "memcpy copies + devgraph replay": lambda: (copies_memcpy(), entry.graph.replay()),
    "foreach copies + devgraph replay": lambda: (copies_foreach(), entry.graph.replay()),
    "memcpy copies + hand replay": lambda: (copies_memcpy(), hand.replay()),
    "runner.run": lambda: r.run(**batch),
}
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times: dict[str, list[float]] = {name: [] for name in variants}
for call in variants.values():
    call()
for _ in range(7):  # the variants take turns, so clock drift hits all alike
    for name, call in variants.items():
        torch.cuda.synchronize()
        a.record()
        for _ in range(20):
            call()
        b.record()
        b.synchronize()
        times[name].append(a.elapsed_time(b) / 20)
for name in variants:
    print(f"{name:40s} {statistics.median(times[name]):.4f} ms")
