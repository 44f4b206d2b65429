"""The contract: what a vendor implements and what model code sees.

``backend`` (the backend ABC and its options), ``platform`` (the platform graph API), ``keys`` (what a
graph is for), ``inputs`` (``StaticInput``), ``phases``, ``modes`` (the words of ``--device-graph-mode``),
``context`` (the forward context) and ``breaks`` (break ops). These modules import nothing of devgraph but
each other and the root leaves (``errors``, ``messages``, ``_version``).
"""
