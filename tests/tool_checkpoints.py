"""Tiny checkpoints that speak tools: the chat templates of real instruct models written into the tiny
random-weight checkpoints of ``checkpoints.py``, with the special tokens those templates use.

``templates/qwen2.5.jinja`` is the chat template Qwen2.5-Instruct ships (Hermes-style ``<tool_call>``
tags; Apache-2.0) and ``templates/llama3.1.jinja`` the one Llama 3.1-Instruct ships (JSON calls with
``"parameters"``, ``Environment: ipython``), each copied unchanged: the server must render tools with the
template's own ``tools`` variable and read calls in the format the template teaches.
"""

from __future__ import annotations

import json
from pathlib import Path

from checkpoints import build_checkpoint

TEMPLATES = Path(__file__).resolve().parent / "templates"
#: Context of these checkpoints: a prompt with tools is a few hundred tokens of the tiny vocabulary.
CONTEXT = 4096
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]


def build_tool_checkpoint(directory: Path, family: str) -> Path:
    """``family``: ``qwen2.5`` (a Qwen2 checkpoint, ``<tool_call>`` and ``</tool_call>`` added as tokens as
    Qwen2.5's tokenizer has them) or ``llama3.1`` (a Llama checkpoint with Llama 3's special tokens,
    ``<|eot_id|>`` its end of turn)."""
    import transformers

    base = "qwen2" if family == "qwen2.5" else "llama"
    build_checkpoint(directory, base, max_position_embeddings=CONTEXT, vocab_size=512)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    if family == "qwen2.5":
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
        tokenizer.chat_template = (TEMPLATES / "qwen2.5.jinja").read_text()
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
        tokenizer.bos_token = "<|begin_of_text|>"
        tokenizer.eos_token = "<|eot_id|>"
        tokenizer.chat_template = (TEMPLATES / "llama3.1.jinja").read_text()
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    assert len(tokenizer) <= 512, len(tokenizer)
    tokenizer.save_pretrained(directory)
    generation = directory / "generation_config.json"
    settings = json.loads(generation.read_text())
    settings["eos_token_id"] = eos
    generation.write_text(json.dumps(settings))
    return directory
