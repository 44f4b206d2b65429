"""devgraph's ``full`` graph against a hand-written ``torch.cuda.CUDAGraph`` of the same forward, taken apart:
the two graphs' replays alone, each with the runner's five input copies in front (``copy_`` per input, and
one ``torch._foreach_copy_``), and ``runner.run()`` whole. Qwen3-0.6B's reference decoder at batch 1 with
cuBLAS projections, milliseconds per step over 20 steps back to back (median of seven); prints only.

    python3 benchmarks/replay_vs_hand.py
"""

import functools

import torch
from harness.timing import graph_of, steps_in_turns

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
hand, _ = graph_of(functools.partial(m.decode_step, **batch))
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
for name, ms in steps_in_turns(variants).items():
    print(f"{name:40s} {ms:.4f} ms")
