"""The benchmark's checkpoint, built on the machine that runs it (no network there): a Qwen3 config,
random weights saved with ``save_pretrained`` in the run's dtype, and a byte-level BPE tokenizer trained
with the ``tokenizers`` library on a few sentences, saved beside it with a chat template.

Weights: every matrix ~ N(0, 1/fan_in) (unit-scale projections, as the reference model draws its random
weights), norms at one. transformers' own initialisation (N(0, 0.02)) makes the tied-embedding model repeat
one or two tokens, which says little about whether two implementations agree; at unit scale each prompt's
continuation varies.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["build_checkpoint", "prompt_set"]

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a graph captured once replays every step of the decoder",
    "hello world, how are you today? fine, thanks!",
    "tokens flow from the prompt through every layer to the logits",
]
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Any:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=_CHATML
    )


def build_checkpoint(directory: Path, shape: dict[str, Any], dtype: str, device: str) -> dict[str, Any]:
    """Write the checkpoint to ``directory``; returns what was built and how long it took."""
    import transformers

    start = time.perf_counter()
    tokenizer = _tokenizer()
    config = transformers.Qwen3Config(eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                draw = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
                param.copy_(draw.mul_(param.shape[1] ** -0.5))
            else:
                param.fill_(1.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    size = sum(p.stat().st_size for p in directory.iterdir())
    return {
        "directory": str(directory),
        "bytes": size,
        "seconds": round(time.perf_counter() - start, 2),
        "weights": "every matrix ~ N(0, 1/fan_in), norms 1, seed 0",
        "architecture": "Qwen3ForCausalLM",
        "dtype": dtype,
    }


def prompt_set(count: int, lengths: tuple[int, int], vocab: int, seed: int = 7) -> list[list[int]]:
    """``count`` prompts of random token ids (ids 3 and up: past the tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]
