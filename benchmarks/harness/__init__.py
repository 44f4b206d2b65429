"""What the benchmarks share, one module per job: ``device`` (timing on a GPU or the CPU simulator, host
time, the time budget), ``timing`` (interleaved variants over the same cases), ``cases`` (seeded batches
whose KV writes never meet another batch's reads), ``hand`` (hand-written graphs), ``floor`` (the
memory-bandwidth floor), ``children`` (sections in processes of their own), ``report`` (the JSON),
``targets`` and ``plots`` (the PNG beside the JSON)."""
