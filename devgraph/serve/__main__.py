"""``python -m devgraph.serve [flags]``: run the server (``bench [flags]``: the load generator)."""

from devgraph.serve.cli import serve_main

raise SystemExit(serve_main())
