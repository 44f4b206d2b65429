"""Serving a Hugging Face checkpoint, in-process: config.json into the reference model (or refused with
every reason), safetensors into its fused weights, the tokenizer and chat template, the generation
config; and the oracle nobody here wrote: the engine's greedy tokens equal transformers' ``generate()``
on the same checkpoint (float32, CPU) in every ``--device-graph-mode``, alone and batched. The
checkpoints are tiny and built locally (``tests/checkpoints.py``); nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from devgraph.errors import ConfigError
from devgraph.reference.rope import RopeScaling
from devgraph.serve.api.stops import StopMatcher
from devgraph.serve.checkpoint import open_model
from devgraph.serve.checkpoint.source import ModelSource
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

MODES = ("disabled", "auto", "full", "breakable", "tc_piecewise")


@pytest.fixture(scope="module")
def sources(hf_cases: dict[str, Any]) -> dict[str, ModelSource]:
    return {family: open_model(str(case.directory)) for family, case in hf_cases.items()}


@pytest.fixture(scope="module")
def models(sources: dict[str, ModelSource]) -> dict[str, Any]:
    built = {}
    for family, source in sources.items():
        config = source.model_config({"max_requests": 4, "max_seq_len": 128})
        built[family] = source.build(config, torch.device("cpu"), seed=0).model
    return built


def _copy(case: Any, tmp_path: Path) -> Path:
    return Path(shutil.copytree(case.directory, tmp_path / case.family))


def _edit_config(directory: Path, **changes: Any) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return directory


# -- the oracle ---------------------------------------------------------------------------------------
def test_the_prompt_set_is_far_from_ties(hf_cases: dict[str, Any]) -> None:
    # Token equality with transformers is only well defined where no greedy step is a near-tie that float32
    # rounding (another matmul order) could flip: the reference model's logits differ from transformers'
    # by at most about 6e-6 on these checkpoints, and every gap between the top two logits is over 1e-4.
    for case in hf_cases.values():
        assert min(g.margin for g in case.expected) > 1e-4, case.family
        assert any(len(set(g.tokens)) > 5 for g in case.expected), "the random model must not just repeat"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_tokens_equal_transformers_alone_and_batched(
    hf_cases: dict[str, Any], sources: dict[str, ModelSource], models: dict[str, Any], family: str, mode: str
) -> None:
    case, source = hf_cases[family], sources[family]
    engine = Engine(models[family], EngineConfig(4, 32), device_graph_mode=mode, progress=False)
    try:
        params = SamplingParams(max_tokens=20, stop_token_ids=source.generation.eos_token_ids)
        expected = [g.tokens for g in case.expected]
        assert engine.generate(case.prompts, params) == expected  # six prompts, four running at once
        assert [engine.generate([p], params)[0] for p in case.prompts] == expected
        if mode != "disabled":
            stats = engine.stats()["runners"]
            assert stats["decode"]["replays"] > 0 and stats["prefill"]["replays"] > 0
    finally:
        engine.close()


def test_logprobs_equal_transformers_log_softmax(
    hf_cases: dict[str, Any], sources: dict[str, ModelSource], models: dict[str, Any]
) -> None:
    case = hf_cases["qwen3"]
    engine = Engine(models["qwen3"], EngineConfig(4, 32), device_graph_mode="auto", progress=False)
    try:
        request = engine.add_request(case.prompts[0], SamplingParams(max_tokens=20, logprobs=3))
        got: list[Any] = []
        while request.status.value != "finished":
            got += [lp for out in engine.step() for lp in (out.logprobs or [])]
    finally:
        engine.close()
    expected = case.expected[0]
    assert [e.token for e in got] == expected.tokens
    assert [e.logprob for e in got] == pytest.approx(expected.logprobs, abs=1e-4)
    assert all(len(e.top) == 3 and e.top[0][0] == e.token for e in got)  # greedy: the best is chosen
    assert all(e.top[0][1] >= e.top[1][1] >= e.top[2][1] for e in got)


# -- config.json --------------------------------------------------------------------------------------
def test_each_family_maps_to_the_reference_models_features(sources: dict[str, ModelSource]) -> None:
    fields = {family: source.checkpoint.model_fields for family, source in sources.items()}  # type: ignore[union-attr]
    assert fields["llama"]["rope_scaling"] == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert not fields["llama"]["tie_embeddings"] and not fields["llama"]["qkv_bias"]
    assert fields["qwen2"]["qkv_bias"] and fields["qwen2"]["tie_embeddings"]
    assert fields["qwen3"]["qk_norm"] and not fields["qwen3"]["qkv_bias"]
    assert fields["mistral"]["rope_scaling"] == RopeScaling("linear", factor=2.0)
    config = sources["qwen3"].model_config({"max_requests": 2})
    assert config.max_seq_len == 256 and config.dtype == torch.float32  # max_position_embeddings
    with pytest.raises(
        ConfigError, match="--max-seq-len 512 is longer .* max_position_embeddings limits it to 256"
    ):
        sources["qwen3"].model_config({"max_seq_len": 512})
    assert sources["qwen3"].model_config({"dtype": "bf16", "max_requests": 2}).dtype == torch.bfloat16


def test_a_transformers_4_config_reads_the_same(
    hf_cases: dict[str, Any], sources: dict[str, ModelSource], tmp_path: Path
) -> None:
    # transformers 4 wrote rope_theta and rope_scaling ("type" or "rope_type") and torch_dtype.
    llama = sources["llama"].checkpoint.model_fields  # type: ignore[union-attr]
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    directory = _edit_config(
        _copy(hf_cases["llama"], tmp_path),
        rope_parameters=None,
        dtype=None,
        rope_theta=10000.0,
        rope_scaling={**scaling, "original_max_position_embeddings": 64},
        torch_dtype="float32",
        some_field_of_a_fine_tuner=1,
    )
    source = open_model(str(directory))
    assert source.checkpoint.model_fields == llama  # type: ignore[union-attr]
    assert any("some_field_of_a_fine_tuner" in note for note in source.checkpoint.notes)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("family", "changes", "needles"),
    [
        (
            "qwen3",
            {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
            ["model_type 'qwen3_moe'"],
        ),
        ("llama", {"quantization_config": {"quant_method": "awq"}}, ["quantization_config ('awq')"]),
        ("llama", {"attention_bias": True, "mlp_bias": True}, ["attention_bias", "mlp_bias"]),
        ("mistral", {"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["rope_type 'yarn'"]),
        ("qwen2", {"rope_parameters": {"rope_type": "longrope"}}, ["rope_type 'longrope'"]),
        ("llama", {"rope_parameters": {"rope_type": "linear"}}, ["rope_type 'linear' without 'factor'"]),
        ("qwen3", {"partial_rotary_factor": 0.5}, ["partial_rotary_factor 0.5"]),
        ("qwen3", {"auto_map": {"AutoModelForCausalLM": "x.Y"}}, ["auto_map"]),
        (
            "qwen3",
            {"layer_types": ["chunked_attention", "full_attention"]},
            ["layer_types ['chunked_attention']"],
        ),
        ("llama", {"architectures": ["LlamaForSequenceClassification"]}, ["LlamaForSequenceClassification"]),
        ("llama", {"dtype": "float8_e4m3fn"}, ["dtype 'float8_e4m3fn'"]),
    ],
)
def test_unsupported_configs_are_refused_naming_every_reason(
    hf_cases: dict[str, Any], tmp_path: Path, family: str, changes: dict[str, Any], needles: list[str]
) -> None:
    directory = _edit_config(_copy(hf_cases[family], tmp_path), **changes)
    with pytest.raises(ConfigError) as info:
        open_model(str(directory))
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_a_sliding_window_or_dynamic_rope_limits_the_context_and_is_exact_inside_it(
    hf_cases: dict[str, Any], tmp_path: Path
) -> None:
    from checkpoints import build_checkpoint, hf_greedy

    mistral = build_checkpoint(tmp_path / "window", "mistral", sliding_window=48)
    source = open_model(str(mistral))
    assert source.model_config({"max_requests": 2}).max_seq_len == 48
    with pytest.raises(ConfigError, match="the sliding attention window limits it to 48"):
        source.model_config({"max_seq_len": 64})
    llama = _edit_config(
        _copy(hf_cases["llama"], tmp_path),
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        max_position_embeddings=96,
    )
    dynamic = open_model(str(llama))
    assert dynamic.model_config({"max_requests": 2}).max_seq_len == 96
    assert dynamic.checkpoint.model_fields["rope_scaling"] == RopeScaling()  # type: ignore[union-attr]
    for directory, src in ((mistral, source), (llama, dynamic)):
        prompts = [src.tokenizer.encode(text) for text in ("hello world", "the quick brown fox")]
        expected = [
            g.tokens for g in hf_greedy(directory, prompts, 24)
        ]  # 44 tokens at most: inside the bound
        model = src.build(src.model_config({"max_requests": 2}), torch.device("cpu"), seed=0).model
        engine = Engine(model, EngineConfig(2, 32), device_graph_mode="disabled", progress=False)
        params = SamplingParams(max_tokens=24, stop_token_ids=src.generation.eos_token_ids)
        assert engine.generate(prompts, params) == expected


# -- weights ------------------------------------------------------------------------------------------
def test_a_sharded_bf16_checkpoint_loads_the_same_weights(hf_cases: dict[str, Any], tmp_path: Path) -> None:
    import transformers

    case = hf_cases["qwen2"]
    directory = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(case.directory).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(case.directory / name, directory / name)
    assert (directory / "model.safetensors.index.json").exists()
    sharded = open_model(str(directory))
    assert sharded.checkpoint.dtype == torch.bfloat16  # type: ignore[union-attr]
    bf16 = sharded.build(sharded.model_config({"max_requests": 2}), torch.device("cpu"), 0).model
    original = open_model(str(case.directory))
    fp32 = original.build(original.model_config({"max_requests": 2}), torch.device("cpu"), 0).model
    for (name, a), (_, b) in zip(bf16.named_parameters(), fp32.named_parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16)), name


def _rewrite_weights(directory: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), "missing 1 tensor(s) the config implies"),
        (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}), "no place for"),
        (
            lambda t: t.update({"model.norm.weight": torch.ones(65)}),
            "tensor model.norm.weight has shape (65,), the config implies (64,)",
        ),
    ],
)
def test_weights_that_disagree_with_the_config_are_refused(
    hf_cases: dict[str, Any], tmp_path: Path, edit: Any, needle: str
) -> None:
    directory = _copy(hf_cases["llama"], tmp_path)
    _rewrite_weights(directory, edit)
    source = open_model(str(directory))
    with pytest.raises(ConfigError) as info:
        source.build(source.model_config({"max_requests": 2}), torch.device("cpu"), 0)
    assert needle in str(info.value)


def test_a_directory_without_safetensors_or_config_is_refused(
    hf_cases: dict[str, Any], tmp_path: Path
) -> None:
    directory = _copy(hf_cases["qwen3"], tmp_path)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weights \(it has pytorch_model.bin\)"):
        open_model(str(directory))
    (directory / "pytorch_model.bin").rename(directory / "model.safetensors")
    (directory / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json"):
        open_model(str(directory))
    with pytest.raises(ConfigError, match="neither a preset .* nor a checkpoint directory"):
        open_model(str(tmp_path / "nowhere"))


# -- tokenizer, chat template, generation config -------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tokenizer_and_chat_template_equal_transformers(
    hf_cases: dict[str, Any], sources: dict[str, ModelSource], family: str
) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(hf_cases[family].directory)
    ours = sources[family].tokenizer
    text = "naïve café: 日本語 🙂 and the quick brown fox"
    assert ours.encode(text) == hf.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.chat_prompt(
        messages, add_generation_prompt=True, continue_final_message=False, template_kwargs={}
    ) == list(expected)
    # Streaming detokenization: pieces concatenate to the text, a split character waits for its bytes.
    ids = hf.encode(text, add_special_tokens=False)
    decoder = ours.decoder(hf.encode("hello"))
    pieces = [decoder.feed([t]) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_generation_config_sets_stop_ids_and_sampling_defaults(
    hf_cases: dict[str, Any], tmp_path: Path
) -> None:
    directory = _copy(hf_cases["qwen3"], tmp_path)
    settings = {
        "eos_token_id": [2, 7],
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
    }
    (directory / "generation_config.json").write_text(json.dumps(settings))
    source = open_model(str(directory))
    eos = source.tokenizer.eos_token_ids
    assert source.generation.eos_token_ids == tuple(dict.fromkeys((2, 7, *eos)))
    assert source.generation.sampling() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert any("repetition_penalty 1.1" in note for note in source.generation.notes)


# -- stop strings -------------------------------------------------------------------------------------
def test_stop_strings_span_pieces_and_cut_at_the_earliest() -> None:
    matcher = StopMatcher(["STOP", "end"])
    assert matcher.feed("hello ST") == "hello "  # "ST" could begin "STOP": held back
    assert matcher.feed("ART again S") == "START again "
    assert matcher.feed("TOP and more") == "" and matcher.stopped
    assert matcher.feed("ignored") == ""
    kept = StopMatcher(["end", "and"], include=True)
    assert kept.feed("one and two end") == "one and" and kept.stopped
    open_ended = StopMatcher(["xyz"])
    assert open_ended.feed("abcx") == "abc" and open_ended.flush() == "x" and not open_ended.stopped
    assert StopMatcher([]).feed("anything") == "anything"


# -- the command line ---------------------------------------------------------------------------------
def test_serve_refuses_in_one_line_and_names_the_missing_extra(
    hf_cases: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from devgraph.cli import main

    directory = _edit_config(_copy(hf_cases["mistral"], tmp_path), hidden_act="gelu", mlp_bias=True)
    assert main(["serve", "--model", str(directory), "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "devgraph serve: error: mistral: MistralForCausalLM is not served"
    )
    assert "hidden_act 'gelu'" in err[0] and "mlp_bias" in err[0]
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as if not installed
    assert main(["serve", "--model", str(hf_cases["qwen3"].directory), "--device", "cpu", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "devgraph serve: error: serving a checkpoint's tokenizer (--model DIR) needs transformers, which is "
        "not installed: pip install 'devgraph[transformers]'"
    )


# -- damaged checkpoints: one line naming the file and what is wrong, exit code 2 ----------------------
@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One servable checkpoint (Qwen3: its tokenizer class builds an empty tokenizer from no files)."""
    for module in ("transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module, reason=f"serving a checkpoint needs {module}")
    from checkpoints import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("intact") / "qwen3", "qwen3")


def _overwrite(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


def _shard(directory: Path, index: dict[str, Any] | None = None) -> None:
    """Turn the single file into shard 1 of 2 and write an index naming shard 2 for half the tensors."""
    from safetensors import safe_open

    first = directory / "model-00001-of-00002.safetensors"
    (directory / "model.safetensors").rename(first)
    with safe_open(str(first), "pt") as handle:
        names = list(handle.keys())
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {name: files[i % 2] for i, name in enumerate(names)}
    text = json.dumps(index if index is not None else {"metadata": {}, "weight_map": weight_map})
    (directory / "model.safetensors.index.json").write_text(text)


DAMAGE: dict[str, tuple[Any, str, str]] = {
    # name: (how to damage the copy, the file named, what the line says is wrong)
    "truncated": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:40000]),
        "model.safetensors",
        "not a readable safetensors file",
    ),
    "overwritten header": (
        lambda d: _overwrite(d / "model.safetensors", 8, b"garbage!" * 4),
        "model.safetensors",
        "invalid JSON in header",
    ),
    "zero bytes": (
        lambda d: (d / "model.safetensors").write_bytes(b""),
        "model.safetensors",
        "header too small",
    ),
    "missing shard": (_shard, "model.safetensors.index.json", "missing from"),
    "empty weight_map": (
        lambda d: _shard(d, {"weight_map": {}}),
        "model.safetensors.index.json",
        "weight_map must be a non-empty object",
    ),
    "a shard outside the directory": (
        lambda d: _shard(d, {"weight_map": {"model.norm.weight": "../../etc/passwd"}}),
        "model.safetensors.index.json",
        "not a file name in the checkpoint directory",
    ),
    "head_dim a string": (
        lambda d: _edit_config(d, head_dim="16"),
        "config.json",
        "head_dim must be a positive integer, got '16' (a str)",
    ),
    "head_dim a float": (
        lambda d: _edit_config(d, head_dim=16.0),
        "config.json",
        "head_dim must be a positive integer, got 16.0 (a float)",
    ),
    "tie_word_embeddings a string": (
        lambda d: _edit_config(d, tie_word_embeddings="false"),
        "config.json",
        "tie_word_embeddings must be true or false, got 'false' (a str)",
    ),
    "a field only transformers checks": (
        lambda d: _edit_config(d, initializer_range="x"),
        "config.json",
        "does not pass transformers' checks (it reads it to load the tokenizer)",
    ),
    "model_type a list": (lambda d: _edit_config(d, model_type=["qwen3"]), "qwen3", "is not supported"),
    "config.json nested 100000 deep": (
        lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        "config.json",
        "nests arrays or objects too deeply",
    ),
    "config.json not UTF-8": (
        lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"),
        "config.json",
        "is not UTF-8 text",
    ),
    "tokenizer.json not JSON": (
        lambda d: (d / "tokenizer.json").write_text("{broken"),
        "tokenizer.json",
        "is not JSON",
    ),
    "no tokenizer files": (
        lambda d: [(d / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json")],
        "qwen3",
        "has no usable tokenizer: transformers built an empty one",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_damaged_checkpoint_is_one_line_naming_the_file(
    intact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    from devgraph.cli import main

    edit, file, needle = DAMAGE[damage]
    directory = Path(shutil.copytree(intact, tmp_path / "qwen3"))
    edit(directory)
    assert main(["serve", "--model", str(directory), "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("devgraph serve: error: "), err
    assert file in err[0] and needle in err[0], err
