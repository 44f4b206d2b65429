"""The registry: hook specifications, what a registration must satisfy, compatibility rules, the
pluggy-fed ``Registry`` (``plugins``), the built-in plug-in and ``register_backend``. Above the contract,
the strategies and the platforms; below the flag, which asks it for the registered mode names.
"""
