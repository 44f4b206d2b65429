"""Real clients on their defaults against ``devgraph serve --model DIR`` (a subprocess, CPU, one torch
thread, a tiny local Llama checkpoint, graphs on): the OpenAI SDK's prompt log-probabilities (``echo``
with ``logprobs``, ``max_tokens: 0``, vLLM's ``prompt_logprobs``) equal transformers' log-softmax of the
same checkpoint; batched prompts, ``n`` and ``best_of`` share one prefill per prompt; streamed usage in
every chunk and no empty-text chunks; ``logprobs: k`` gives k alternatives and chat's ``bytes`` the
token's own; vLLM's dashboard metric names. lm-eval's ``local-completions`` (batch sizes 1 and 4) runs a
multiple-choice, a ``loglikelihood_rolling`` and a ``generate_until`` task from local files and its
per-item log-likelihoods equal lm-eval's own ``hf`` model's; guidellm's sweep finishes without errors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from servers import ServerProcess, stream_events

aiohttp = pytest.importorskip("aiohttp", reason="devgraph serve needs aiohttp")
openai = pytest.importorskip("openai", reason="these tests drive the server with the OpenAI SDK")
pytestmark = [pytest.mark.timeout(300)]

FLAGS = ["--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "4", "--token-budget", "32"]


@pytest.fixture(scope="module")
def case(hf_cases: dict[str, Any]) -> Any:
    return hf_cases["llama"]


@pytest.fixture(scope="module")
def server(case: Any) -> Iterator[ServerProcess]:
    process = ServerProcess("--model", str(case.directory), *FLAGS)
    try:
        yield process
    finally:
        assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _hf_prompt_logprobs(directory: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax (float32) of every prompt token after the first, given the ones before."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logp = logits.log_softmax(-1)
    return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


# -- prompt log-probabilities --------------------------------------------------------------------------
def test_echo_with_logprobs_equals_transformers_log_softmax(case: Any, client: Any) -> None:
    prompt = case.prompts[4]  # longer than the 32-token step budget: a chunked prefill
    expected = _hf_prompt_logprobs(case.directory, prompt).tolist()
    name = str(case.directory)
    for max_tokens in (0, 1):  # 0 as the API and vLLM accept; 1 as lm-eval sends
        result = client.completions.create(
            model=name, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
        )
        logprobs = result.choices[0].logprobs
        assert len(logprobs.tokens) == len(prompt) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
        for score, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True):
            assert 1 <= len(top) <= 2 and score in top.values()  # the top-1 and the token itself
        assert result.usage.completion_tokens == max_tokens
    extended = client.completions.create(
        model=name, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    scored = extended.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    got = [entry[str(token)]["logprob"] for entry, token in zip(scored[1:], prompt[1:], strict=True)]
    assert got == pytest.approx(expected, abs=1e-4)


def test_echo_with_logprobs_scores_every_prompt_token_even_where_its_text_is_empty(client: Any) -> None:
    # An empty prompt is its BOS token alone: echo's text is "" but the token is the prompt's, as
    # usage counts it (the log probabilities left it out while the prompt had no text).
    for prompt, max_tokens in (("", 0), ("", 2), ("hello", 0)):
        result = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1
        )
        logprobs = result.choices[0].logprobs
        assert len(logprobs.tokens) == result.usage.prompt_tokens + max_tokens, (prompt, logprobs)
        assert logprobs.token_logprobs[0] is None and logprobs.text_offset[0] == 0
        assert result.choices[0].text.startswith(prompt)


# -- batched prompts, n and best_of ---------------------------------------------------------------------
def test_batched_prompts_and_n_copies_share_one_prefill_per_prompt(
    case: Any, client: Any, server: ServerProcess
) -> None:
    name = str(case.directory)
    prompts = case.prompts[:2]
    texts = ["the quick brown fox", "hello world"]
    alone = [
        client.completions.create(model=name, prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in [*prompts, *texts]
    ]
    before = server.wait_idle()["prefill_tokens"]
    batched = client.completions.create(model=name, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    assert [c.text for c in batched.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert server.wait_idle()["prefill_tokens"] - before == sum(len(p) for p in prompts)  # not n times
    by_text = client.completions.create(model=name, prompt=texts, max_tokens=6, temperature=0)
    assert [c.text for c in by_text.choices] == alone[2:]
    sampled = client.completions.create(model=name, prompt=texts[0], max_tokens=6, temperature=1, seed=3, n=3)
    assert len({c.text for c in sampled.choices}) > 1 and sampled.usage.completion_tokens <= 18
    best = client.completions.create(
        model=name, prompt=texts[0], max_tokens=6, temperature=1, seed=3, best_of=3, logprobs=0
    )
    assert len(best.choices) == 1 and best.choices[0].index == 0
    ranked = sorted(sum(c.logprobs.token_logprobs) for c in _scored(client, name, texts[0]).choices)
    assert sum(best.choices[0].logprobs.token_logprobs) == pytest.approx(ranked[-1], abs=1e-5)
    stats = server.wait_idle()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _scored(client: Any, name: str, prompt: str) -> Any:
    """The same three seeded copies best_of=3 ranks, each with its log probabilities."""
    return client.completions.create(
        model=name, prompt=prompt, max_tokens=6, temperature=1, seed=3, n=3, logprobs=0
    )


# -- streaming -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_carry_usage_in_every_chunk_and_no_empty_text_chunks(
    case: Any, server: ServerProcess, path: str
) -> None:
    chat = path.endswith("chat/completions")
    request: dict[str, Any] = {"max_tokens": 16, "temperature": 1, "seed": 7, "ignore_eos": True}
    request.update(
        {"messages": [{"role": "user", "content": "日本語 🙂"}]} if chat else {"prompt": "日本語 🙂"}
    )
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = asyncio.run(stream_events(server.url, {**request, "stream_options": options}, path))
    assert all(e["usage"] is not None for e in events)
    completion = [e["usage"]["completion_tokens"] for e in events]
    assert completion == sorted(completion) and completion[-1] == 16
    ids: list[int] = []
    for event in events[:-1]:
        (choice,) = event["choices"]
        part = choice.get("delta", choice)
        text = part.get("content", part.get("text"))
        ids += part.get("token_ids", [])
        if choice["finish_reason"] is None and part.get("role") is None:
            assert text, event  # a chunk a client counts as a token has text
    assert events[-1]["choices"] == [] and len(ids) == 16


# -- logprobs exactly as the API defines -----------------------------------------------------------------
def test_logprobs_give_k_alternatives_and_each_tokens_own_bytes(case: Any, client: Any) -> None:
    name = str(case.directory)
    completion = client.completions.create(
        model=name,
        prompt="日本語 🙂",
        max_tokens=12,
        temperature=1,
        seed=5,
        logprobs=20,
        extra_body={"ignore_eos": True},
    )
    logprobs = completion.choices[0].logprobs
    assert all(len(top) in (20, 21) for top in logprobs.top_logprobs)  # k, and the chosen token
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True))
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "日本語 🙂"}],
        max_tokens=12,
        temperature=1,
        seed=5,
        logprobs=True,
        top_logprobs=20,
    )
    content = chat.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == 20 for entry in content)
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", errors="replace") == chat.choices[0].message.content
    split = [e for e in content if e.token.startswith("bytes:")]
    assert all(bytes(e.bytes) != "\ufffd".encode() for e in split)


# -- metrics ----------------------------------------------------------------------------------------------
def test_metrics_carry_the_dashboards_names(case: Any, client: Any, server: ServerProcess) -> None:
    pytest.importorskip("prometheus_client")
    client.completions.create(model=str(case.directory), prompt="hello", max_tokens=5, temperature=0, n=2)
    status, text = server.request("GET", "/metrics")
    assert status == 200
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert types["vllm:gpu_cache_usage_perc"] == "gauge"
    for name in (
        "vllm:time_per_output_token_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_max_num_generation_tokens",
    ):
        assert types[name] == "histogram", name
        count = next(line for line in text.splitlines() if line.startswith(name + "_count"))
        assert float(count.rsplit(" ", 1)[1]) > 0, count


# -- lm-eval ----------------------------------------------------------------------------------------------
TASKS = {
    "devgraph_mc": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    },
    "devgraph_rolling": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{question}}",
        "metric_list": [{"metric": "word_perplexity"}],
    },
    "devgraph_gen": {
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{choices[answer]}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
}
DOCS = [
    {
        "question": "the quick brown fox jumps over the",
        "choices": [" lazy dog", " graph", " layer"],
        "answer": 0,
    },
    {"question": "hello world, how are you", "choices": [" today?", " fine", " tokens"], "answer": 0},
    {"question": "def main(): return", "choices": [" 42", " the", " café"], "answer": 0},
    {
        "question": "a graph captured once replays",
        "choices": [" every step", " emoji", " 日本語"],
        "answer": 0,
    },
]


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    yaml = pytest.importorskip("yaml")
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for task, config in TASKS.items():
        full = {
            "task": task,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **config,
        }
        (root / f"{task}.yaml").write_text(yaml.safe_dump(full))
    return root


def _lm_eval(tasks: Path, model: str, model_args: str, batch_size: int) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` (what its command line runs) on the local tasks: each task's samples,
    by document."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
    )
    assert results is not None
    return {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in TASKS}


def _scores(samples: dict[str, Any]) -> list[float]:
    """Every log-likelihood lm-eval recorded, task by task, item by item."""
    values: list[float] = []

    def walk(value: Any) -> None:
        if isinstance(value, bool):  # an is_greedy flag
            return
        if isinstance(value, (int, float)):
            values.append(float(value))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    for task in ("devgraph_mc", "devgraph_rolling"):
        for sample in samples[task]:
            walk(sample["resps"])
    return values


@pytest.mark.slow
def test_lm_eval_local_completions_equals_its_hf_model(
    case: Any, server: ServerProcess, lm_eval_tasks: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path),
    }.items():
        monkeypatch.setenv(name, value)
    pytest.importorskip("lm_eval", reason="the client under test")
    pytest.importorskip("accelerate", reason="lm-eval's hf model, the oracle")
    name = str(case.directory)
    # lm-eval's hf model adds the tokenizer's BOS by default, local-completions does not (add_bos_token
    # False): the oracle is told to send the same tokens as the client on its defaults.
    oracle = f"pretrained={name},dtype=float32,add_bos_token=False"
    hf = _lm_eval(lm_eval_tasks, "hf", oracle, 1)
    expected = _scores(hf)
    assert len(expected) == len(DOCS) * 4  # three choices and one rolling document per item
    for batch_size in (1, 4):
        served = _lm_eval(
            lm_eval_tasks,
            "local-completions",
            f"model={name},base_url={server.url}/v1/completions",
            batch_size,
        )
        assert _scores(served) == pytest.approx(expected, abs=1e-4)
        generated = [s["resps"][0][0] for s in served["devgraph_gen"]]
        assert len(generated) == len(DOCS) and all(isinstance(text, str) for text in generated)


# -- guidellm ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_sweep_finishes_without_errors(
    case: Any, server: ServerProcess, tmp_path: Path, route: str
) -> None:
    """guidellm's sweep (its default streams with include_usage and continuous_usage_stats), kept short:
    three benchmarks of six requests each."""
    pytest.importorskip("guidellm", reason="the client under test")
    report = tmp_path / "report.json"
    backend = f"kind=openai_http,target={server.url},model={case.directory},request_format={route}"
    command = [
        sys.executable, "-m", "guidellm", "run", "--backend", backend,
        "--profile", "kind=sweep,sweep_size=3,max_concurrency=4", "--constraint", "kind=max_requests,count=6",
        "--data", "kind=synthetic_text,prompt_tokens=12,output_tokens=6",
        "--output", f"kind=json,path={report}", "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 3
    for benchmark in benchmarks:
        totals = benchmark["metrics"]["request_totals"]
        assert totals["errored"] == 0 and totals["successful"] == 6, totals
