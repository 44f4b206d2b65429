"""``python -m devgraph.serve [flags]`` is ``devgraph serve [flags]``; ``python -m devgraph.serve bench
[flags]`` is ``devgraph bench serve [flags]``."""

import sys

from devgraph.serve.cli import serve_main

raise SystemExit(serve_main(sys.argv[1:]))
