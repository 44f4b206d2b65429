"""``GraphRunner`` and its parts: the plan (the flag and the arguments resolved once), the key schedule,
staging of a step's inputs, the dispatcher, capture (``capture/``), outputs (``outputs/``), lazily
captured graphs, declared state, statistics, ``verify()``, ``inspect()`` and Prometheus metrics.
"""
