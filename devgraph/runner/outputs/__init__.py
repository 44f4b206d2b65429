"""What a forward returns: pytree helpers every path shares (``trees``) and which leaves are row-major, cut
back to a step's real counts (``layout``).
"""
