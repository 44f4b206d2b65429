"""The parts of ``bench_zoo.py``: ``setup`` (the zoo's models at the benchmark's shape, their cases),
``variants`` (eager, hand-written graphs, devgraph ``full`` plain and compiled, reduce-overhead), ``timing``
(interleaved steps with a per-step reset outside the timed region), ``results`` (floors, targets, the
decision table, the plot)."""
