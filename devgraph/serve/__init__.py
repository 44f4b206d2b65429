"""``devgraph serve``: the reference engine behind an OpenAI-style HTTP API, and its load generator.

Modules: ``tokenizer`` (the byte-level tokenizer), ``protocol`` (request checking, response shapes),
``app`` (aiohttp routes), ``metrics`` (Prometheus), ``server`` (start-up and SIGTERM), ``loadgen`` and
``report`` (``devgraph bench serve``). aiohttp is imported only by the modules that
need it. Run ``python -m devgraph.serve --help`` or ``devgraph serve --help``; see docs/serving.md.
"""

from devgraph.serve.tokenizer import ByteTokenizer, StreamDecoder

__all__ = ["ByteTokenizer", "StreamDecoder"]
