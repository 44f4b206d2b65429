"""The serving application: ``devgraph serve`` and ``devgraph bench serve``, one unit above the library.

``engine/`` (paged KV blocks, continuous batching, chunked prefill, sampling, each forward through a
``GraphRunner``), ``api/`` (the OpenAI-style HTTP API: request checking, aiohttp routes, Prometheus
metrics, start-up and SIGTERM, the byte-level tokenizer), ``bench/`` (the load generator and its report)
and ``cli`` (the arguments of both commands). The library never imports this package; aiohttp is
imported only by the modules that need it. Run ``python -m devgraph.serve --help`` or
``devgraph serve --help``; see docs/serving.md.
"""
