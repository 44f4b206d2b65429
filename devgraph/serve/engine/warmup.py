"""The start-up warm-up's size: two throw-away requests, cut to fit any context the flags allow."""

from __future__ import annotations

from devgraph import ConfigError
from devgraph.reference.config import ReferenceConfig

__all__ = ["WARMUP_OUTPUT", "WARMUP_PROMPT", "check_warm_up_fits", "warm_up_lengths"]

#: The start-up warm-up's longer prompt and its output (tokens), both cut to the context.
WARMUP_PROMPT = 100
WARMUP_OUTPUT = 2


def warm_up_lengths(config: ReferenceConfig) -> tuple[int, int]:
    """The warm-up's longer prompt and its ``max_tokens``, cut so the request fits any context of two or
    more tokens (the smallest ``--max-seq-len``): the warm-up is the server's, never the user's problem."""
    output = max(1, min(WARMUP_OUTPUT, config.max_seq_len - 1))
    return max(1, min(WARMUP_PROMPT, config.max_seq_len - output)), output


def check_warm_up_fits(config: ReferenceConfig) -> int:
    """The warm-up's longer prompt length; :class:`ConfigError` naming the ``--num-blocks`` it needs when
    the KV cache cannot hold that request (call it before allocating anything)."""
    longest, output = warm_up_lengths(config)
    tokens = longest + output
    needed = -(-tokens // config.block_size)
    usable = config.total_blocks - 1  # block 0 is scratch
    if needed > usable:
        raise ConfigError(
            f"the KV cache is too small for the start-up warm-up: {usable} usable block(s) of "
            f"{config.block_size} positions hold {usable * config.block_size} tokens, the warm-up request "
            f"needs {tokens} ({needed} blocks); raise num_blocks (--num-blocks) to at least {needed + 1} "
            "(block 0 is scratch)"
        )
    return longest
