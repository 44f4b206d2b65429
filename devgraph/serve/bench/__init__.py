"""``devgraph bench serve``: a trace of requests against a running server (``loadgen``) and its summary
and plot (``report``)."""
