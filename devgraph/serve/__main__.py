"""``python -m devgraph.serve [arguments]`` is ``devgraph serve [arguments]``; ``python -m devgraph.serve
bench [arguments]`` is ``devgraph bench serve [arguments]``."""

import sys

from devgraph.serve.cli import serve_main

raise SystemExit(serve_main(sys.argv[1:]))
