"""``--device-graph-mode`` and what it selects: the values a phase may hold (``values``), size lists
(``sizes``), the parsed flag (``config``) and the factory that turns a device, a phase and the flag into a
platform and a backend (``factory``). Above the registry, below the runner.
"""
