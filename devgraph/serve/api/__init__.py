"""``devgraph serve``'s HTTP side: request checking and response shapes (``protocol``), aiohttp routes
(``app``), Prometheus metrics (``metrics``), start-up and SIGTERM (``server``), the byte-level tokenizer
(``tokenizer``)."""
