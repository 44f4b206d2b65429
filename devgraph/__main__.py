from devgraph.cli.main import main

raise SystemExit(main())
