"""``python -m devgraph.serve [flags]`` is ``devgraph serve [flags]``; ``python -m devgraph.serve bench
[flags]`` is ``devgraph bench serve [flags]``."""

import sys

from devgraph.cli import main

_argv = sys.argv[1:]
raise SystemExit(main(["bench", "serve", *_argv[1:]] if _argv[:1] == ["bench"] else ["serve", *_argv]))
