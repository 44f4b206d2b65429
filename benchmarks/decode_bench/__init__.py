"""The parts of ``bench_decode.py``: ``plan`` (what runs), ``setup`` (model, twin, batches, references),
``variants`` (eager, hand-written and devgraph variants, each checked), ``host`` (host time per run and per
break), ``children`` (the reduce-overhead and fresh-process children), ``sections`` (the run, section by
section, within the time budget), ``targets`` and ``plots``."""
