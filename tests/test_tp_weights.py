"""Large checkpoints for ``serve --tp``: a rank reads only its rows or columns of each tensor from the
memory-mapped file, and the tests' streaming writer (``write_random_checkpoint``, how the 8B-shaped
benchmark checkpoint is made) writes safetensors shards that transformers and devgraph both read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="checkpoints are safetensors")
pytest.importorskip("transformers", reason="the writer takes its tensor names from transformers")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    from checkpoints import write_random_checkpoint

    directory = tmp_path_factory.mktemp("streamed") / "llama"
    report = write_random_checkpoint(directory, "llama", shard_bytes=60_000, seed=3)
    return directory, report


def test_the_streamed_checkpoint_is_what_transformers_and_devgraph_read(written: tuple[Path, dict]) -> None:
    import transformers

    from devgraph.serve.checkpoint import open_model

    directory, report = written
    assert report["shards"] > 1 and (directory / "model.safetensors.index.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert hf.dtype == torch.bfloat16
    state = hf.state_dict()
    assert report["tensors"] == len(state) and report["bytes"] == sum(t.nbytes for t in state.values())
    source = open_model(str(directory))
    model = source.build(source.model_config({"max_requests": 2}), torch.device("cpu"), seed=0).model
    layer = model.layers[1]
    q = model.config.num_heads * model.config.head_dim
    assert torch.equal(model.embed.data, state["model.embed_tokens.weight"])
    assert torch.equal(layer.qkv_proj.data[:q], state["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(layer.down_proj.data, state["model.layers.1.mlp.down_proj.weight"])
    norm = state["model.layers.1.input_layernorm.weight"].float()
    assert 0.3 < norm.std().item() * 5 < 2  # norm scales drawn around 1, not left at 1


def test_a_rank_reads_its_rows_or_columns_alone(written: tuple[Path, dict]) -> None:
    """Each slot's part comes straight from the file, equal to that part of the whole tensor."""
    from safetensors import safe_open

    from devgraph.serve.checkpoint.weights import WeightFiles, _read, _Slot

    directory, _ = written
    files = WeightFiles.find(directory)
    names = {
        "model.layers.0.self_attn.q_proj.weight": (0, slice(32, 64)),  # rank 1 of 2: its output rows
        "model.layers.0.mlp.down_proj.weight": (1, slice(64, 128)),  # its input columns
        "model.norm.weight": None,  # whole
    }
    slots = {}
    for name, part in names.items():
        with safe_open(str(directory / files.where[name]), framework="pt") as handle:
            shape = tuple(handle.get_slice(name).get_shape())
        slots[name] = _Slot(torch.empty(0), shape, part)
    for name, shape, read in _read(files, slots):
        with safe_open(str(directory / files.where[name]), framework="pt") as handle:
            whole = handle.get_tensor(name)
        part = names[name]
        expected = whole if part is None else whole[part[1]] if part[0] == 0 else whole[:, part[1]]
        got = read()
        assert shape == tuple(whole.shape)
        assert got.shape == expected.shape and torch.equal(got, expected), name


def test_the_8b_shape_is_llama_3_8b() -> None:
    """8.03 B parameters, 16.06 GB in bf16: what the serving benchmark's floor is computed from."""
    import transformers
    from checkpoints import FAMILIES, LLAMA3_8B, SHAPE

    config = transformers.LlamaConfig(**{**SHAPE, **FAMILIES["llama"], **LLAMA3_8B})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert 8.02e9 < params < 8.04e9


def test_the_benchmarks_tokenizer_gives_every_id_of_the_vocabulary_text(tmp_path: Path) -> None:
    """A random model samples any id: under ``words=True`` each one decodes to text of its own, so a stream
    sends a chunk per token (the BPE tokenizer's 400 tokens leave most ids of a 32000 vocabulary without
    text, and a stream holds those back until the request ends)."""
    import transformers
    from checkpoints import write_random_checkpoint

    directory = tmp_path / "words"
    write_random_checkpoint(directory, "llama", words=True, vocab_size=1200, num_hidden_layers=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == 1200 and tokenizer.eos_token_id == 2
    ids = list(range(3, 1200))
    texts = [tokenizer.decode([i]) for i in ids]
    assert all(texts) and len(set(texts)) == len(ids)
    assert tokenizer(" ".join(texts[:5]))["input_ids"] == [1, *ids[:5]]  # BOS, then the words back
