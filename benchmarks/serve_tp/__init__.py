"""The pieces of ``benchmarks/serve_tp_check.py``: what is run (``plan``), one server measured from the
outside and through its step timeline (``runs``), the figures and targets drawn from them (``analysis``),
and the picture (``plot``)."""
