"""The decode loop ``generate()`` hands its work to (``custom_generate=``): what HF's ``_sample`` does for
greedy search and sampling, with every decode forward replayed from a device graph.

HF prepares everything before the loop (generation config, special tokens, the 2-D mask, position ids,
logits processors, stopping criteria) and returns what the loop returns. The loop runs the prefill eagerly
through HF's own ``prepare_inputs_for_generation`` and forward, writes the padding mask once into the
decoder's static mask buffer, then per token: copies the last logits to float32 (the copy HF makes too),
applies the logits processors, picks the token (argmax or multinomial), pads finished rows, checks the
stopping criteria, streams, and replays the decode graph. When the only stopping criterion is the length,
the loop does not read the device each token (HF's loop does, to test ``unfinished.max() == 0``): the host
queues steps ahead of the device, with the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from devgraph import InputError
from devgraph.integrations.hf.features import ModelFeatures
from devgraph.integrations.hf.lib import transformers
from devgraph.integrations.hf.support import GRAPH_MODES

__all__ = ["DecodeLoop"]

#: ``step(input_ids [n, 1], position_ids [n, 1], length) -> logits [n, 1, vocab]``, valid until the next step.
Step = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def _start_positions(input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> torch.Tensor:
    """``[n, 1]`` positions of the first decode token: one past the prompt's last position."""
    positions = model_kwargs.get("position_ids")
    if positions is not None:
        return positions[:, -1:] + 1
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return mask.long().sum(-1, keepdim=True)
    return torch.full((input_ids.shape[0], 1), input_ids.shape[1], dtype=torch.long, device=input_ids.device)


def _length_only(stopping_criteria: Any) -> int | None:
    """The length at which generation stops when that is the only criterion (else ``None``)."""
    criteria = list(stopping_criteria)
    max_length = getattr(transformers().generation.stopping_criteria, "MaxLengthCriteria", None)
    if max_length is None or not criteria or any(type(c) is not max_length for c in criteria):
        return None  # (a release without that class: the loop checks every criterion each token)
    return min(int(c.max_length) for c in criteria)


class DecodeLoop:
    """``custom_generate`` for one ``generate()`` call. ``start(rows, prompt_mask)`` prepares the decode
    step's static mask; ``step`` runs one decode step through the runner; ``max_cache_len`` bounds the
    call's length; ``features`` names the cache keyword and output field of the installed transformers;
    ``streamer`` is the call's streamer (``generate()`` does not hand it to a callable)."""

    def __init__(
        self,
        start: Callable[[int, torch.Tensor | None], None],
        step: Step,
        max_cache_len: int,
        device: torch.device,
        features: ModelFeatures,
        streamer: Any = None,
    ) -> None:
        self.start = start
        self.step = step
        self.max_cache_len = max_cache_len
        self.device = device
        self.features = features
        self.streamer = streamer
        self.steps = 0

    def __call__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        **model_kwargs: Any,
    ) -> Any:
        tf = transformers()
        mode = generation_config.get_generation_mode()
        if getattr(mode, "value", mode) not in GRAPH_MODES:
            raise InputError(
                f"the devgraph decode loop runs {GRAPH_MODES}, got {mode}; this is a devgraph bug"
            )
        max_length = int(generation_config.max_length)
        if max_length > self.max_cache_len:
            raise InputError(
                f"this generate() needs {max_length} cache positions, the decoder's cache holds "
                f"{self.max_cache_len}: build the DevgraphDecoder with a larger max_cache_len= or ask for "
                "fewer max_new_tokens"
            )
        rows = input_ids.shape[0]
        streamer = self.streamer
        pad_token = getattr(generation_config, "_pad_token_tensor", None)
        if pad_token is None and isinstance(generation_config.pad_token_id, int):
            pad_token = torch.tensor(generation_config.pad_token_id)  # (a release without the private copy)
        has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        if has_eos and pad_token is None:
            raise InputError(
                "generation stops at an EOS token but no pad_token_id is set: pass pad_token_id="
            )
        if pad_token is not None:
            pad_token = pad_token.to(input_ids.device)
        dict_out = bool(generation_config.return_dict_in_generate)
        scores: tuple[torch.Tensor, ...] | None = () if dict_out and generation_config.output_scores else None
        raw_logits: tuple[torch.Tensor, ...] | None = (
            () if dict_out and generation_config.output_logits else None
        )
        stop_length = None if streamer is not None else _length_only(stopping_criteria)
        unfinished = torch.ones(rows, dtype=torch.long, device=input_ids.device)

        # Prefill: eager, through HF's own input preparation and forward, on the caller's rows of the cache.
        inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
        logits = model(**inputs, return_dict=True).logits
        positions = _start_positions(input_ids, model_kwargs).to(self.device)
        self.start(rows, model_kwargs.get("attention_mask"))

        while True:
            # The one copy HF makes too: the next replay overwrites the graph's logits.
            step_logits = logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            step_scores = logits_processor(input_ids, step_logits)
            if scores is not None:
                scores += (step_scores,)
            if raw_logits is not None:
                raw_logits += (step_logits,)
            if generation_config.do_sample:
                probs = torch.nn.functional.softmax(step_scores, dim=-1)
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(step_scores, dim=-1)
            if has_eos and pad_token is not None:  # (checked above: EOS criteria come with a pad token)
                next_tokens = next_tokens * unfinished + pad_token * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if stop_length is not None:
                if input_ids.shape[1] >= stop_length:
                    break
            else:
                unfinished = unfinished & ~stopping_criteria(input_ids, scores)
                if streamer is not None:
                    streamer.put(next_tokens.cpu())
                if unfinished.max() == 0:
                    break
            logits = self.step(next_tokens[:, None].to(self.device), positions, input_ids.shape[1])
            self.steps += 1
            positions = positions + 1

        if streamer is not None:
            streamer.end()
        if dict_out:
            cache = model_kwargs.get(self.features.cache_argument)
            return tf.generation.utils.GenerateDecoderOnlyOutput(
                sequences=input_ids,
                scores=scores,
                logits=raw_logits,
                **{self.features.output_cache_field: cache},
            )
        return input_ids
