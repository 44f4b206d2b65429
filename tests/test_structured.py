"""Structured output in the engine: llguidance grammars compiled from fuzzed JSON schemas, regexes and
choices, masked onto real logits after the graphs, with real tokenizers (a byte-level BPE checkpoint
tokenizer with added tokens, Llama 3 special tokens, and the byte tokenizer of the presets).

Every output that finishes parses and follows its schema; the graphs keep replaying; a request's mask
never touches the other rows of its step; what the library refuses, and work past the limits, is a
:class:`GrammarError` naming why.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from devgraph.reference.config import ReferenceConfig
from devgraph.reference.model import ReferenceModel
from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer
from devgraph.serve.engine import Engine, EngineConfig, FinishReason, SamplingParams
from devgraph.serve.engine.grammar import GrammarFailed
from devgraph.serve.structured import GrammarCompiler, GrammarError, GrammarKind, GrammarSpec, Whitespace
from devgraph.serve.structured.vocab import BYTE_END_TOKEN

pytest.importorskip("llguidance", reason="structured output needs llguidance (the structured extra)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- fuzzed schemas, and a validator for the keywords they use -----------------------------------------
def _leaf(rng: random.Random) -> dict[str, Any]:
    low = rng.randint(-50, 50)
    return rng.choice(
        [
            {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 300)},
            {"type": "boolean"},
            {"type": "null"},
            {"enum": rng.sample(["red", "green", "blue", 7, "naïve café", "日本", None], rng.randint(1, 4))},
            {"type": "string", "maxLength": rng.randint(1, 6)},
            {"type": "string", "pattern": "^[a-z]{1,4}$"},
            {"const": rng.choice(["fixed", 42, True])},
        ]
    )


def fuzz_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random schema of bounded output (strings, arrays and integers all have limits)."""
    kind = rng.random()
    if depth >= 2 or kind < 0.3:
        return _leaf(rng)
    if kind < 0.45:
        return {"type": "array", "items": fuzz_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind < 0.55:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    names = rng.sample(["id", "name", "tags", "ok", "kind", "value", "ünï"], rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: fuzz_schema(rng, depth + 1) for name in names},
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


def follows(value: Any, schema: dict[str, Any]) -> bool:
    """Whether ``value`` follows ``schema`` (the keywords :func:`fuzz_schema` writes)."""
    if "anyOf" in schema:
        return any(follows(value, option) for option in schema["anyOf"])
    if "const" in schema:
        return value == schema["const"] and type(value) is type(schema["const"])
    if "enum" in schema:
        return any(value == e and type(value) is type(e) for e in schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    if kind == "boolean":
        return type(value) is bool
    if kind == "null":
        return value is None
    if kind == "string":
        if not isinstance(value, str) or len(value) > schema.get("maxLength", len(value)):
            return False
        return "pattern" not in schema or re.search(schema["pattern"], value) is not None
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(follows(item, schema["items"]) for item in value)
        )
    if kind == "object":
        properties = schema["properties"]
        return (
            isinstance(value, dict)
            and set(value) <= set(properties)
            and set(schema["required"]) <= set(value)
            and all(follows(v, properties[k]) for k, v in value.items())
        )
    raise AssertionError(f"the validator does not know {schema}")


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers(tool_checkpoints: dict[str, Path]) -> dict[str, Any]:
    from devgraph.serve.checkpoint.hf_tokenizer import HFTokenizer

    return {
        "bpe": HFTokenizer(tool_checkpoints["qwen2.5"]),
        "llama3": HFTokenizer(tool_checkpoints["llama3.1"]),
        "bytes": ByteTokenizer(),
    }


def _engine(mode: str = "auto", **config: Any) -> Engine:
    model = ReferenceModel(ReferenceConfig.preset("tiny"), device="cpu", seed=0)
    settings = {"max_running_requests": 8, "token_budget": 64, **config}
    return Engine(model, EngineConfig(**settings), device_graph_mode=mode)


def _compiler(tokenizer: Any) -> GrammarCompiler:
    ends = tokenizer.eos_token_ids if not isinstance(tokenizer, ByteTokenizer) else ()
    return GrammarCompiler(tokenizer, ReferenceConfig.preset("tiny").vocab_size, ends)


def _params(grammar: Any, **options: Any) -> SamplingParams:
    return SamplingParams(stop_token_ids=grammar.end_ids, grammar=grammar, **{"max_tokens": 200, **options})


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
    return requests


# -- every output parses -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bpe", "llama3", "bytes"])
def test_fuzzed_schemas_give_outputs_that_parse_and_follow_them(
    tokenizers: dict[str, Any], name: str
) -> None:
    tokenizer = tokenizers[name]
    compiler = _compiler(tokenizer)
    rng = random.Random(f"schemas-{name}")
    schemas = [fuzz_schema(rng) for _ in range(12)]
    params, cases = [], []
    for index, schema in enumerate(schemas):
        # Compact JSON for half of them, bounded whitespace runs for the others; greedy and sampled.
        spec = GrammarSpec.json_schema(schema, strict=True, whitespace=Whitespace(compact=index % 2 == 0))
        grammar = compiler.compile_now(spec)
        for seed in (None, index):
            sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {}
            params.append(_params(grammar, **sampling))
            cases.append(schema)
    prompt = tokenizer.encode("the quick brown fox") if name != "bytes" else list(b"json: ")
    requests = _run(_engine(), [prompt] * len(params), params)
    finished = 0
    for request, schema in zip(requests, cases, strict=True):
        text = tokenizer.decode(request.output)
        if request.finish_reason is FinishReason.LENGTH:
            continue  # a cut output is a prefix the grammar accepted (the matcher took every token)
        assert request.finish_reason is FinishReason.STOP, (request.finish_reason, text)
        value = json.loads(text)
        assert follows(value, schema), (text, schema)
        finished += 1
    assert finished >= 0.8 * len(requests), f"only {finished} of {len(requests)} outputs finished"


@pytest.mark.parametrize("name", ["bpe", "bytes"])
def test_regexes_choices_and_grammars_hold(tokenizers: dict[str, Any], name: str) -> None:
    tokenizer = tokenizers[name]
    compiler = _compiler(tokenizer)
    cases = [
        (
            GrammarSpec(GrammarKind.REGEX, r"[a-f]{2,5}-[0-9]{3}"),
            lambda t: re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", t),
        ),
        (GrammarSpec.choice(["yes", "no", "naïve café"]), lambda t: t in ("yes", "no", "naïve café")),
        (GrammarSpec(GrammarKind.GRAMMAR, 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'), None),
        (
            GrammarSpec(GrammarKind.GRAMMAR, 'root ::= "x" [0-9] [0-9]?'),
            lambda t: re.fullmatch(r"x[0-9]{1,2}", t),
        ),
        (GrammarSpec(GrammarKind.JSON_OBJECT, "", whitespace=Whitespace(compact=True)), None),
    ]
    grammars = [compiler.compile_now(spec) for spec, _ in cases]
    params = [_params(g, max_tokens=120, temperature=1.0, seed=i) for i, g in enumerate(grammars)]
    requests = _run(_engine(), [tokenizer.encode("hello world")] * len(params), params)
    for request, (spec, check) in zip(requests, cases, strict=True):
        text = tokenizer.decode(request.output)
        if request.finish_reason is FinishReason.LENGTH and spec.kind is GrammarKind.JSON_OBJECT:
            continue  # any object may be longer than the budget
        assert request.finish_reason is FinishReason.STOP, (spec, text)
        if spec.kind is GrammarKind.JSON_OBJECT:
            assert isinstance(json.loads(text), dict)
        elif check is None:
            assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text), text
        else:
            assert check(text), (spec, text)


# -- the graphs, the other rows ------------------------------------------------------------------------
def test_graphs_keep_replaying_and_other_rows_are_untouched(tokenizers: dict[str, Any]) -> None:
    """Deterministic steps (one shape per phase), so an unconstrained request's tokens depend on it alone:
    they are the same beside constrained requests as alone, and every decode step replayed a graph."""
    tokenizer = tokenizers["bytes"]
    grammar = _compiler(tokenizer).compile_now(GrammarSpec(GrammarKind.REGEX, "[0-9]{20}"))
    free = SamplingParams(max_tokens=24)
    alone = _run(_engine(deterministic=True), [[5, 6, 7]], [free])[0].output
    engine = _engine(deterministic=True)
    requests = _run(
        engine, [[5, 6, 7], [1, 2], [3]], [free, _params(grammar), _params(grammar, temperature=1.0)]
    )
    assert requests[0].output == alone
    for request in requests[1:]:
        assert re.fullmatch(r"[0-9]{20}", tokenizer.decode(request.output))
    decode = engine.decode_runner.stats()
    assert decode["replays"] > 0 and decode["eager"] == 0, decode


def test_the_mask_allows_exactly_what_the_grammar_allows(tokenizers: dict[str, Any]) -> None:
    grammar = _compiler(tokenizers["bytes"]).compile_now(GrammarSpec(GrammarKind.REGEX, "[0-9]+"))
    state = grammar.start()
    logits = torch.zeros(3, 512)
    masked = state.masker.mask(logits, [1], [state])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])  # rows without a grammar
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed == list(b"0123456789")  # no end yet: the regex needs a digit first
    assert state.advance(ord("4")) is False
    allowed = torch.isfinite(state.masker.mask(logits, [0], [state])[0]).nonzero().flatten().tolist()
    assert allowed == [*b"0123456789", BYTE_END_TOKEN]
    with pytest.raises(GrammarFailed, match="could not follow its grammar"):
        state.advance(ord("x"))


class _FailingState:
    """A grammar state that fails on its third token (as one whose grammar grew past its limits would)."""

    def __init__(self, masker: Any) -> None:
        self.masker, self.matcher, self.taken = masker, None, 0

    def advance(self, token: int) -> bool:
        self.taken += 1
        if self.taken == 3:
            raise GrammarFailed("the grammar gave up")
        return False


class _IdentityMasker:
    def mask(self, logits: torch.Tensor, rows: Any, states: Any) -> torch.Tensor:
        return logits


class _FailingGrammar:
    def start(self) -> _FailingState:
        return _FailingState(_IdentityMasker())


def test_a_grammar_that_fails_ends_its_request_alone() -> None:
    engine = _engine()
    failing, other = _run(
        engine,
        [[1, 2], [3, 4]],
        [SamplingParams(max_tokens=8, grammar=_FailingGrammar()), SamplingParams(max_tokens=8)],
    )
    assert failing.finish_reason is FinishReason.ERROR and len(failing.output) == 2
    assert other.finish_reason is FinishReason.LENGTH and len(other.output) == 8


# -- what is refused, and the bounds -------------------------------------------------------------------
def test_the_library_reason_is_the_error(tokenizers: dict[str, Any]) -> None:
    compiler = _compiler(tokenizers["bpe"])
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        compiler.compile_now(GrammarSpec.json_schema({"not": {"type": "string"}}, strict=True))
    compiler.compile_now(GrammarSpec.json_schema({"not": {"type": "string"}}, strict=False))  # ignored
    with pytest.raises(GrammarError, match="regex parse error"):
        compiler.compile_now(GrammarSpec(GrammarKind.REGEX, "(("))
    with pytest.raises(GrammarError, match="Unknown format"):
        compiler.compile_now(GrammarSpec.json_schema({"type": "string", "format": "weird"}, strict=True))
    with pytest.raises(GrammarError, match="unknown name"):
        compiler.compile_now(GrammarSpec(GrammarKind.GRAMMAR, "start: missing_rule"))


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema(
            {
                "type": "object",
                "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(300)]} for i in range(200)},
            }
        ),
        GrammarSpec.json_schema(
            {"type": "object", "properties": {"a": {"type": "string", "format": "x"}}}, strict=True
        ),
    ],
    ids=["schema-too-large", "unknown-format"],
)
def test_work_past_the_limits_is_refused_quickly(tokenizers: dict[str, Any], spec: GrammarSpec) -> None:
    began = time.perf_counter()
    with pytest.raises(GrammarError, match="refused by llguidance"):
        _compiler(tokenizers["bpe"]).compile_now(spec)
    assert time.perf_counter() - began < 5


def test_compiled_grammars_are_cached_and_the_operator_decides(tokenizers: dict[str, Any]) -> None:
    import asyncio

    from devgraph.serve.structured import GrammarRefused

    compiler = _compiler(tokenizers["bpe"])
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})

    async def twice() -> tuple[Any, Any]:
        return await compiler.compile(spec), await compiler.compile(
            GrammarSpec.json_schema(json.loads(spec.source))
        )

    first, second = asyncio.run(twice())
    assert first is second
    assert first.start().matcher is not second.start().matcher  # each request has its own state
    only_json = GrammarCompiler(tokenizers["bpe"], 512, tokenizers["bpe"].eos_token_ids, allowed="json")
    only_json.compile_now(spec)
    with pytest.raises(GrammarRefused, match="--structured-outputs json"):
        only_json.compile_now(GrammarSpec(GrammarKind.REGEX, "a+"))
    with pytest.raises(GrammarRefused, match="--structured-outputs none"):
        GrammarCompiler(tokenizers["bpe"], 512, (), allowed="none").compile_now(spec)


def test_a_deeply_nested_grammar_compiles_instead_of_crashing_the_server(tokenizers: dict[str, Any]) -> None:
    """A chain of 10000 rules makes the library recurse 10000 deep while it compiles: on an 8 MiB
    stack the process died (SIGSEGV); the compile threads' deep stack takes it, and its masks work."""
    chain = "start: r0\n" + "".join(f'r{i}: "a" | "b" r{i + 1}\n' for i in range(10_000)) + 'r10000: "c"\n'
    grammar = _compiler(tokenizers["bytes"]).compile_now(GrammarSpec(GrammarKind.GRAMMAR, chain))
    engine = _engine()
    request = _run(engine, [[1, 2]], [_params(grammar, max_tokens=40, temperature=1.0, seed=1)])[0]
    assert re.fullmatch(r"b*(a|c)?", ByteTokenizer().decode(request.output)), request.output


def test_properties_come_in_the_schema_order(tokenizers: dict[str, Any]) -> None:
    """llguidance writes properties in the order the schema lists them: the spec keeps that order (a
    schema whose keys were sorted made every output's keys alphabetical)."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "null"}, "mid": {"enum": [1, 2]}},
        "required": ["zeta", "alpha", "mid"],
        "additionalProperties": False,
    }
    grammar = _compiler(tokenizers["bpe"]).compile_now(
        GrammarSpec.json_schema(schema, whitespace=Whitespace(compact=True))
    )
    request = _run(_engine(), [tokenizers["bpe"].encode("x")], [_params(grammar)])[0]
    assert request.finish_reason is FinishReason.STOP
    assert list(json.loads(tokenizers["bpe"].decode(request.output))) == ["zeta", "alpha", "mid"]


def test_logprobs_of_a_constrained_request_name_only_allowed_tokens(tokenizers: dict[str, Any]) -> None:
    grammar = _compiler(tokenizers["bytes"]).compile_now(GrammarSpec.choice(["ab"]))
    engine = _engine()
    request = engine.add_request([1, 2], _params(grammar, logprobs=5))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert request.finish_reason is FinishReason.STOP and bytes(request.output) == b"ab"
    entries = [entry for output in outputs for entry in output.logprobs or []]
    assert [e.token for e in entries] == list(b"ab")
    for entry in entries:  # one token allowed at each step: it is the only alternative, with all the mass
        assert entry.top == ((entry.token, entry.logprob),) and abs(entry.logprob) < 1e-5


def test_without_llguidance_a_constrained_request_is_a_501_naming_the_extra(
    tokenizers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import sys

    from devgraph.serve.api.fields import Generation
    from devgraph.serve.api.protocol import ApiError
    from devgraph.serve.api.structured import attach_grammar

    monkeypatch.setitem(sys.modules, "llguidance", None)  # what an environment without it imports
    generation = Generation(
        [1], SamplingParams(), False, False, (), False, "m", grammar=GrammarSpec.choice(["a"])
    )
    with pytest.raises(ApiError) as caught:
        asyncio.run(attach_grammar(_compiler(tokenizers["bytes"]), generation))
    assert caught.value.status == 501 and "pip install 'devgraph[structured]'" in caught.value.message


@pytest.mark.cuda
def test_on_cuda_masks_equal_the_hosts_and_the_decode_graphs_replay(tokenizers: dict[str, Any]) -> None:
    """The bitmask goes to the device from pinned memory without a wait: the masked logits must equal the
    CPU's, and a constrained run must keep every decode step on the CUDA graphs."""
    tokenizer = tokenizers["bpe"]
    grammar = _compiler(tokenizer).compile_now(
        GrammarSpec.json_schema({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}})
    )
    states = [grammar.start() for _ in range(3)]
    states[1].advance(tokenizer.encode("[")[-1])
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    on_host = states[0].masker.mask(logits, [0, 2, 3], states)
    on_device = states[0].masker.mask(logits.cuda(), [0, 2, 3], states)
    assert torch.equal(on_device.cpu(), on_host)
    model = ReferenceModel(ReferenceConfig.preset("tiny"), device="cuda", seed=0)
    engine = Engine(model, EngineConfig(max_running_requests=8, token_budget=64), device_graph_mode="auto")
    params = [_params(grammar, temperature=1.0, seed=seed) for seed in range(8)]
    requests = _run(engine, [tokenizer.encode("numbers:")] * 8, params)
    for request in requests:
        if request.finish_reason is FinishReason.STOP:
            assert all(0 <= n <= 99 for n in json.loads(tokenizer.decode(request.output)))
    decode = engine.decode_runner.stats()
    assert decode["replays"] > 0 and decode["eager"] == 0, decode
