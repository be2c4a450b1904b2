"""The serving path end to end: real gateway process, real worker, real HTTP clients."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Server, decode_together, leave_after_events

MAX = 16


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def chat_ids(server: Server, content: str, max_tokens: int = MAX, **extra: object) -> dict:
    r = httpx.post(
        f"{server.v1}/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def assert_idle(server: Server) -> None:
    stats = server.worker_stats()
    assert stats["requests"] == 0 and stats["batch_rows"] == 0, stats


# -- the openai SDK -----------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion_non_streaming(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=MAX,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens > 5
    assert 1 <= r.usage.completion_tokens <= MAX
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == "tiny"


def test_chat_completion_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=MAX, temperature=0
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_text_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=MAX, temperature=0
    )
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert r.usage is not None
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=MAX, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_sse_wire_format_ends_with_done(server: Server) -> None:
    with httpx.stream(
        "POST",
        f"{server.v1}/completions",
        json={"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True},
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e.removeprefix("data: "))


# -- greedy parity against mlx-lm in-process ---------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(tiny_model_dir))

    def generate(prompt_ids: list[int], n: int) -> list[int]:
        out = []
        for resp in stream_generate(
            model, tokenizer, prompt_ids, max_tokens=n, sampler=make_sampler(temp=0.0)
        ):
            out.append(int(resp.token))
            if resp.token in tokenizer.eos_token_ids:
                break
        return out

    return generate


@pytest.mark.parametrize(
    "content",
    ["Hello", "What is the capital of France?", "a b c d e f g", "The quick brown fox " * 5],
)
def test_greedy_parity_with_mlx_lm_generate(server: Server, reference, content: str) -> None:
    body = chat_ids(server, content)
    expected = reference(body["prompt_token_ids"], MAX)
    assert body["choices"][0]["token_ids"] == expected


# -- continuous batching ---------------------------------------------------------------


def test_concurrent_streams_share_steps_and_match_solo(server: Server) -> None:
    no_eos = {"0": -100, "1": -100, "2": -100}
    bodies = [
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Request number {i} asks something"}],
            "max_tokens": 3000,
            "temperature": 0,
            "logit_bias": no_eos,
            "return_token_ids": True,
        }
        for i in range(8)
    ]
    solo = [
        httpx.post(
            f"{server.v1}/chat/completions", json={**b, "max_tokens": 24}, timeout=120
        ).json()["choices"][0]["token_ids"]
        for b in bodies
    ]
    together, stats = decode_together(server, "/chat/completions", bodies, 24)
    assert [len(s) for s in solo] == [24] * 8
    assert together == solo
    # all eight decode as rows of one batch, not one after another
    assert stats["decoding"] == 8, stats
    server.wait_idle()


# -- disconnects -----------------------------------------------------------------


def test_client_disconnect_aborts_the_request(server: Server) -> None:
    before = server.worker_stats()
    assert leave_after_events(server, "long one") == 3
    # The worker learns of it through an Abort; wait for that via the stats call
    # (each call is answered between engine steps).
    for _ in range(200):
        after = server.worker_stats()
        if after["requests_aborted"] > before["requests_aborted"]:
            break
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["requests"] == 0 and after["batch_rows"] == 0
    # generation stopped far short of max_tokens
    assert after["generated_tokens"] - before["generated_tokens"] < 1000
    # later requests are unaffected
    assert len(chat_ids(server, "after the disconnect", 5)["choices"][0]["token_ids"]) == 5


# -- stop strings --------------------------------------------------------------------


def test_stop_string_is_excluded_and_aborts(server: Server) -> None:
    full = chat_ids(server, "stop test", 24)
    text = full["choices"][0]["message"]["content"]
    if len(text) < 6:
        pytest.skip("random model produced too little text")
    stop = text[3:6]
    r = chat_ids(server, "stop test", 24, stop=[stop])
    got = r["choices"][0]["message"]["content"]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert got == text[: text.index(stop)]
    assert r["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
    assert_idle(server)


# -- malformed requests ---------------------------------------------------------------


def _post(server: Server, path: str, **kw: object) -> httpx.Response:
    return httpx.post(server.url + path, timeout=30, **kw)  # type: ignore[arg-type]


def _ok_body(**over: object) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(over)
    return body


BAD = [
    ("not json", {"content": b"{nope", "headers": {"Content-Type": "application/json"}}, 400),
    ("wrong content type", {"content": b"hello", "headers": {"Content-Type": "text/plain"}}, 415),
    ("empty body", {"content": b"", "headers": {"Content-Type": "application/json"}}, 400),
    ("array body", {"json": [1, 2]}, 400),
    ("missing messages", {"json": {"model": "tiny"}}, 400),
    ("empty messages", {"json": _ok_body(messages=[])}, 400),
    ("bad role", {"json": _ok_body(messages=[{"role": "wizard", "content": "x"}])}, 400),
    ("max_tokens string", {"json": _ok_body(max_tokens="many")}, 400),
    ("max_tokens zero", {"json": _ok_body(max_tokens=0)}, 400),
    ("max_tokens negative", {"json": _ok_body(max_tokens=-5)}, 400),
    ("temperature too high", {"json": _ok_body(temperature=7)}, 400),
    ("top_p zero", {"json": _ok_body(top_p=0)}, 400),
    ("stop wrong type", {"json": _ok_body(stop=5)}, 400),
    ("n over the limit", {"json": _ok_body(n=17)}, 400),
    ("tools unsupported", {"json": _ok_body(tools=[{"type": "function"}])}, 400),
    (
        "image part",
        {
            "json": _ok_body(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            )
        },
        400,
    ),
    ("over context", {"json": _ok_body(max_tokens=10**6)}, 400),
    ("unknown model", {"json": _ok_body(model="gpt-17")}, 404),
    (
        "oversized body",
        {
            "content": b'{"x": "' + b"a" * (9 * 1024 * 1024) + b'"}',
            "headers": {"Content-Type": "application/json"},
        },
        413,
    ),
]


@pytest.mark.parametrize(("name", "kw", "status"), BAD, ids=[b[0] for b in BAD])
def test_malformed_requests_get_openai_errors(
    server: Server, name: str, kw: dict, status: int
) -> None:
    r = _post(server, "/v1/chat/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text


def test_bad_completion_prompts(server: Server) -> None:
    for prompt in ([], [[1, 2], []], [[1, 2], [-1]], [-1, 5], [10**9], [[1]] * 17):
        r = _post(
            server, "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 400, (prompt, r.text)
        assert "error" in r.json()


def test_unknown_route_and_method(server: Server) -> None:
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.v1 + "/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_worker_still_serves_after_bad_input(server: Server, client: openai.OpenAI) -> None:
    for _, kw, _status in BAD:
        _post(server, "/v1/chat/completions", **kw)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0
    )
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert_idle(server)


def test_request_id_is_echoed(server: Server) -> None:
    r = httpx.post(
        f"{server.v1}/chat/completions",
        json=_ok_body(),
        headers={"X-Request-ID": "trace-me-42"},
        timeout=30,
    )
    assert r.headers["X-Request-ID"] == "trace-me-42"
    # The client's id is a label: the completion id is built from the internal one.
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", r.json()["id"])


def test_the_tokenizer_loads_beside_the_workers_start(server: Server, tiny_model_dir: Path) -> None:
    """A local model directory's tokenizer is built while the worker starts, and
    kept because the worker reports the same files and EOS ids in Ready."""
    from gateway.serving.tokenizer import Frontend
    from worker.runner import Runner

    assert "tokenizer loaded beside the worker's start" in server.log()
    early = Frontend(str(tiny_model_dir), None, threads=1)
    try:
        assert early.eos_token_ids == frozenset(Runner(tiny_model_dir).info.eos_token_ids)
    finally:
        early.close()
