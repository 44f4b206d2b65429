"""Chat templates, rendered bounded: a template sent in a request is refused unless the server trusts them
(``--trust-request-chat-template``); ``chat_template_kwargs`` are template variables only; a render that
loops, allocates or writes without end is stopped at its budget in its worker process while ``/health``,
completions and other chats are answered, and SIGTERM still stops the server; text that is not Unicode is
a 400. The checkpoint is tiny and built here (``tests/checkpoints.py``)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from devgraph.errors import InputError
from devgraph.serve.checkpoint import open_model
from devgraph.serve.checkpoint.template_render import RenderLimits, TemplateRenderer
from devgraph.serve.checkpoint.text import ChatTemplateError

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
#: 10**10 iterations: the request that froze the whole server when templates rendered on its event loop.
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
#: The same loops writing nothing: only the time bound can stop them (the one above grows its output,
#: so the memory bound may stop it first on a fast machine).
SILENT_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module, reason=f"serving a checkpoint needs {module}")
    from checkpoints import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("chat") / "qwen3", "qwen3")


def chat(tokenizer: Any, **kwargs: Any) -> list[int]:
    return list(
        tokenizer.chat_prompt(
            MESSAGES, add_generation_prompt=True, continue_final_message=False, template_kwargs=kwargs
        )
    )


def test_the_rendered_chat_equals_transformers_and_request_templates_need_trust(checkpoint: Path) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    source = open_model(str(checkpoint))
    tokenizer = source.tokenizer
    try:
        expected = hf.apply_chat_template(
            MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert chat(tokenizer) == list(expected)
        assert chat(tokenizer, enable_thinking=False) == list(expected)  # a template variable: data
        with pytest.raises(ChatTemplateError, match="--trust-request-chat-template"):
            chat(tokenizer, chat_template="{{ messages[0]['content'] }}")
        for reserved in ("tokenize", "messages", "add_generation_prompt", "return_dict"):
            with pytest.raises(ChatTemplateError, match=f"may not set {reserved}"):
                chat(tokenizer, **{reserved: True})
        with pytest.raises(InputError, match=r"lone surrogate \(U\+D800\)"):
            tokenizer.encode("bad \ud800 text")
    finally:
        tokenizer.close()
    trusting = open_model(str(checkpoint), trust_request_template=True).tokenizer
    try:
        own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        assert chat(trusting, chat_template=own) == hf.encode(
            "[system] be brief\n[user] hello world\n", add_special_tokens=False
        )
        with pytest.raises(ChatTemplateError, match="text of a Jinja template"):
            chat(trusting, chat_template=["not", "text"])
    finally:
        trusting.close()


def test_a_render_is_bounded_in_time_memory_and_output_and_the_pool_recovers(checkpoint: Path) -> None:
    limits = RenderLimits(seconds=1.5, max_chars=1 << 20, memory_bytes=256 << 20, workers=1)
    tokenizer = open_model(str(checkpoint), trust_request_template=True, render_limits=limits).tokenizer
    try:
        chat(tokenizer)  # the worker is up
        cases = [
            (SILENT_LOOPS, "did not finish within 1.5 s"),
            (NESTED_LOOPS, "did not finish within 1.5 s|more memory than a render may take"),
            ("{{ 'x' * 10**11 }}", "more memory than a render may take"),
            ("{{ 'x' * (2 * 10**6) }}", "more than 1048576"),
            (
                "{{ raise_exception('no system prompts here') }}",
                "refused the messages: TemplateError: no system",
            ),
        ]
        for template, needle in cases:
            start = time.monotonic()
            with pytest.raises(ChatTemplateError, match=needle):
                chat(tokenizer, chat_template=template)
            assert time.monotonic() - start < limits.seconds + 3, template
            assert len(chat(tokenizer)) > 0  # the one worker (or its replacement) renders again
    finally:
        tokenizer.close()


def test_a_busy_pool_is_503_and_close_ends_waiting_renders() -> None:
    pytest.importorskip("transformers", reason="the worker renders with transformers' renderer")
    from devgraph.serve.checkpoint.template_render import RendererBusy

    renderer = TemplateRenderer(RenderLimits(seconds=1.0, workers=1))
    outcome: list[BaseException] = []

    def render() -> None:
        try:
            renderer.render(NESTED_LOOPS, [{"role": "user", "content": "x"}], {}, **_PROMPT)
        except BaseException as exc:
            outcome.append(exc)

    def start_slow() -> threading.Thread:
        thread = threading.Thread(target=render)
        thread.start()
        time.sleep(0.2)
        return thread

    renderer.render("{{ messages[0]['content'] }}", [{"role": "user", "content": "up"}], {}, **_PROMPT)
    slow = [start_slow(), start_slow()]  # one renders for its whole budget, the next waits for it
    with pytest.raises(RendererBusy, match="busy"):  # no worker free within a budget
        renderer.render("{{ 1 }}", [{"role": "user", "content": "x"}], {}, **_PROMPT)
    for thread in slow:
        thread.join()
    assert len(outcome) == 2 and all(isinstance(e, ChatTemplateError) for e in outcome), outcome
    slow = [start_slow()]
    start = time.monotonic()
    renderer.close()
    slow[0].join()
    assert time.monotonic() - start < 0.9 and isinstance(outcome[2], RendererBusy), outcome


_PROMPT = {"add_generation_prompt": False, "continue_final_message": False}


def test_a_hostile_template_never_stalls_the_server_and_sigterm_stops_it(checkpoint: Path) -> None:
    from servers import ServerProcess

    server = ServerProcess(
        "--model",
        str(checkpoint),
        "--device",
        "cpu",
        "--device-graph-mode",
        "disabled",
        "--trust-request-chat-template",
        "--chat-template-timeout",
        "2",
    )
    hostile = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}}
    answers: list[tuple[int, Any]] = []
    try:
        assert server.post({"messages": MESSAGES, "max_tokens": 2}, "/v1/chat/completions")[0] == 200
        loops = threading.Thread(target=lambda: answers.append(server.post(hostile, "/v1/chat/completions")))
        loops.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert _get(server.url + "/health", timeout=2) == 200
        assert server.post({"prompt": "hello", "max_tokens": 2})[0] == 200
        assert server.post({"messages": MESSAGES, "max_tokens": 2}, "/v1/chat/completions")[0] == 200
        assert time.monotonic() - start < 2.0  # answered while the loops render
        loops.join(timeout=30)
        status, body = answers[0]
        assert status == 400 and "did not finish within 2 s" in body["error"]["message"], body
        too_big = {**hostile, "chat_template": "{{ 'x' * 10**11 }}", "chat_template_kwargs": {}}
        status, body = server.post(too_big, "/v1/chat/completions")
        assert status == 400 and "memory" in body["error"]["message"], body
        for payload, route in (
            ({"prompt": "a \ud800 b"}, "/v1/completions"),
            (_surrogate_chat(), "/v1/chat/completions"),
        ):
            status, body = server.post(payload, route)
            assert status == 400 and "lone surrogate" in body["error"]["message"], body
        # SIGTERM while a render loops: the server stops within the render's budget, exit code 0.
        threading.Thread(target=_post_quietly, args=(server, hostile), daemon=True).start()
        time.sleep(0.5)
        start = time.monotonic()
        assert server.stop() == 0
        assert time.monotonic() - start < 15
    finally:
        server.stop()
    assert not any("Traceback" in line for line in server.stderr), "".join(server.stderr)[-3000:]


def _post_quietly(server: Any, payload: dict[str, Any]) -> None:
    """A chat request whose connection the stopping server may close: any answer, or none, will do."""
    with contextlib.suppress(OSError):
        server.post(payload, "/v1/chat/completions")


def _surrogate_chat() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x \udfff y"}], "max_tokens": 2}


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        json.loads(response.read())
        return int(response.status)
