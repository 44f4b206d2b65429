"""A Hugging Face BERT encoder (random weights) as an ``encode`` phase: each row a sequence of fixed length,
its attention mask a second input (padding rows keep every token visible, so no row is all masked)."""

from __future__ import annotations

import torch

from devgraph import StaticInput
from zoo.base import Shape, ZooModel

SEQUENCE = 16


def build_bert(shape: Shape, device: str, dtype: torch.dtype) -> ZooModel:
    import transformers as tf

    config = tf.BertConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=max(SEQUENCE, 64),
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.BertModel(config, add_pooling_layer=False).to(dtype=dtype).eval()

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # The additive 4-D mask, built here: given the 2-D one, transformers checks on the host whether any
        # token is masked (a `bool(tensor)`), which no graph can hold.
        blocked = (1 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        return model(input_ids=input_ids, attention_mask=blocked).last_hidden_state

    def make_step(n: int, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, SEQUENCE + 1, (n,), generator=generator)
        mask = (torch.arange(SEQUENCE)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, shape.vocab, (n, SEQUENCE), generator=generator) * mask
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}

    return ZooModel(
        name="hf_bert",
        forward=forward,
        phase="encode",
        inputs={
            "input_ids": StaticInput(torch.long, (SEQUENCE,), fill=0),
            "attention_mask": StaticInput(torch.long, (SEQUENCE,), fill=1),
        },
        make_step=make_step,
        module=model,
        notes=(f"transformers {tf.__version__}", f"{SEQUENCE} tokens per sequence"),
    )
