"""An example devgraph plug-in (see README.md): one backend, ``cpu:example_full``."""

from devgraph_example_plugin.backend import ExampleFullBackend

__all__ = ["ExampleFullBackend"]
