"""OpenAI API conformance (issue #14): every response shape against the official spec,
and the bugs and requests the spec allows, through the official `openai` and
`anthropic` SDKs against a real server running the embedded default model
(SmolLM2-135M-Instruct: real text, so spaces and UTF-8 are real too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.helpers import TOOLS_KEY, Server, start_server, stop_server
from tests.spec import assert_valid

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
HI = [{"role": "user", "content": "Say hi"}]
NO_EOS = {"0": -100, "2": -100}  # SmolLM2's <|endoftext|> and <|im_end|>


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "conformance.log"
    server = start_server("default", log)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=300)


def post(srv: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.v1 + route, json={"model": MODEL, **body}, timeout=300)


def sse(srv: Server, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every data chunk of a stream (raw JSON: the SDK would hide absent keys)."""
    out = []
    with httpx.stream(
        "POST", srv.v1 + route, json={"model": MODEL, "stream": True, **body}, timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


# -- every response shape against the spec --------------------------------------------


def test_chat_completion_and_chunks_match_the_spec(srv: Server) -> None:
    r = post(srv, "/chat/completions", {"messages": HI, "max_tokens": 8, "logprobs": True})
    assert r.status_code == 200, r.text
    assert_valid(r.json(), "CreateChatCompletionResponse")
    chunks = sse(
        srv,
        "/chat/completions",
        {
            "messages": HI,
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 2,
            "stream_options": {"include_usage": True},
        },
    )
    for c in chunks:
        assert_valid(c, "CreateChatCompletionStreamResponse")


def test_completion_and_chunks_match_the_spec(srv: Server) -> None:
    r = post(srv, "/completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2})
    assert r.status_code == 200, r.text
    assert_valid(r.json(), "CreateCompletionResponse")
    # EOS banned: the default temperature samples, and an early EOS would end on "stop"
    body = {"prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "logit_bias": NO_EOS}
    chunks = sse(srv, "/completions", body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for c in chunks:
        # The spec has no completion chunk schema: streams reuse CreateCompletionResponse,
        # whose finish_reason is not nullable, yet OpenAI (like mlxd) sends null until the
        # last chunk. Everything else must match.
        for choice in c["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "length"
        assert_valid(c, "CreateCompletionResponse")


def test_models_match_the_spec(srv: Server) -> None:
    models = httpx.get(srv.v1 + "/models", timeout=30).json()
    assert_valid(models, "ListModelsResponse")
    assert_valid(httpx.get(srv.v1 + f"/models/{MODEL}", timeout=30).json(), "Model")


@pytest.mark.parametrize(
    ("route", "body", "status"),
    [
        ("/chat/completions", {"messages": []}, 400),
        ("/chat/completions", {"messages": HI, "temperature": "hot"}, 400),
        ("/completions", {"prompt": PROMPT, "model": "no-such-model"}, 404),
        ("/completions", {"prompt": PROMPT, "suffix": "!"}, 400),
    ],
)
def test_error_bodies_match_the_spec(
    srv: Server, route: str, body: dict[str, Any], status: int
) -> None:
    r = post(srv, route, body)
    assert r.status_code == status, r.text
    assert_valid(r.json(), "ErrorResponse")


# -- bugs 1-8 ---------------------------------------------------------------------------


def test_completion_keeps_the_first_space(srv: Server, client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    text = r.choices[0].text
    assert text.startswith(" "), text
    assert r.choices[0].logprobs is not None
    assert "".join(r.choices[0].logprobs.tokens or []) == text
    # prompt + text is what the model wrote: the prompt's and the answer's tokens, decoded
    ids = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"]  # type: ignore[index]
    from transformers import AutoTokenizer

    from worker.modelfiles.default_model import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    assert PROMPT + text == tok.decode(ids)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_null_means_the_default(client: openai.OpenAI) -> None:
    nulls: dict[str, Any] = {
        k: None
        for k in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "logprobs",
            "top_logprobs",
            "n",
            "stream",
            "stop",
            "seed",
            "stream_options",
            "response_format",
            "logit_bias",
            "tools",
            "tool_choice",
            "user",
        )
    }
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, **nulls)  # type: ignore[call-overload]
    assert r.choices[0].message.content
    c = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=None, logprobs=None, echo=None, n=None
    )
    assert c.choices[0].text


def test_refusal_is_null(srv: Server) -> None:
    body = post(srv, "/chat/completions", {"messages": HI, "max_tokens": 4, "logprobs": True})
    choice = body.json()["choices"][0]
    assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
    assert "refusal" in choice["logprobs"] and choice["logprobs"]["refusal"] is None


def test_logprobs_cover_exactly_the_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=200, temperature=0, logprobs=True
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # ended on <|im_end|>, which the text never shows
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = [t.token for t in choice.logprobs.content]
    assert "<|im_end|>" not in tokens
    assert "".join(tokens) == choice.message.content
    # Cut by a stop string (/v1/completions): no token past the cut.
    c = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, stop=["."]
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    assert c.choices[0].text == " Paris" and lp.tokens == [" Paris"]


def test_logprob_bytes_rebuild_split_characters(client: openai.OpenAI) -> None:
    word = "é🙂日本"
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Smile"}],
        max_tokens=30,
        logprobs=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "string", "enum": [word]}},
        },
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    raw = [bytes(t.bytes or []) for t in content]
    assert (
        b"".join(raw).decode()
        == r.choices[0].message.content
        == json.dumps(word, ensure_ascii=False)
    )
    partial = [b for b in raw if not _is_utf8(b)]
    assert partial, "expected a token holding part of a character"


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_completion_text_offset(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.text_offset
    full = PROMPT + r.choices[0].text
    assert lp.text_offset[0] == len(PROMPT)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert full[offset:].startswith(token)


def test_usage_is_null_on_every_chunk_before_the_usage_chunk(srv: Server) -> None:
    for route, body in (
        ("/chat/completions", {"messages": HI}),
        ("/completions", {"prompt": PROMPT}),
    ):
        # EOS banned: the default temperature samples, and an early EOS would
        # make fewer than 4 tokens
        options = {"max_tokens": 4, "logit_bias": NO_EOS, "stream_options": {"include_usage": True}}
        chunks = sse(srv, route, {**body, **options})
        *rest, last = chunks
        assert all("usage" in c and c["usage"] is None for c in rest), rest
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4


def test_anthropic_models_list(srv: Server) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    page = client.models.list()
    assert [m.id for m in page.data] == [MODEL]
    m = page.data[0]
    assert m.type == "model" and m.display_name == MODEL and m.created_at.year >= 2024
    assert page.has_more is False and page.first_id == page.last_id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    # Without the header: OpenAI's shape, unchanged.
    assert httpx.get(srv.v1 + "/models", timeout=30).json()["object"] == "list"


# -- requests the spec allows ---------------------------------------------------------


def test_n_choices_with_a_seed(client: openai.OpenAI) -> None:
    def run() -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=12, temperature=1.5, seed=7, n=3, logit_bias=NO_EOS
        )

    one = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    a, b = run(), run()
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # reproducible
    assert len(set(texts)) == 3  # and distinct
    # Usage as OpenAI counts it: the prompt once, completion tokens summed.
    assert a.usage is not None and one.usage is not None
    assert a.usage.prompt_tokens == one.usage.prompt_tokens
    assert all(c.finish_reason == "length" for c in a.choices)  # EOS is banned
    assert a.usage.completion_tokens == 3 * 12
    single = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, temperature=1.5, seed=7, logit_bias=NO_EOS
    )
    assert single.choices[0].message.content == texts[0]  # choice 0 uses the seed itself


def test_n_choices_share_the_prompt_prefill(client: openai.OpenAI) -> None:
    # A prompt no earlier test sent: nothing of it is cached before this request.
    story = " ".join(f"word{i}" for i in range(60))
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": story}], max_tokens=4, n=3
    )
    assert len(r.choices) == 3 and r.usage is not None
    details = r.usage.prompt_tokens_details
    # The prime request put the prompt's state in the prefix cache: the rows
    # prefilled only the last prompt token (usage counts the prompt once).
    assert details is not None and details.cached_tokens == r.usage.prompt_tokens - 1


def test_n_choices_stream_each_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=6, n=2, stream=True, temperature=0
    )
    text = {0: "", 1: ""}
    finished = set()
    for c in stream:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert text[0] == text[1] != ""  # greedy: both choices agree


def test_n_choices_cancelled_together(srv: Server) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 2000, "n": 3, "stream": True}
    body["logit_bias"] = NO_EOS  # every row runs until aborted
    with httpx.stream("POST", srv.v1 + "/chat/completions", json=body, timeout=300) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    if ch["delta"].get("content"):
                        seen.add(ch["index"])
            if len(seen) == 3:
                break
    srv.wait_idle()  # every row aborted in the worker


def test_prompt_list_with_n_and_echo(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "1, 2, 3,"]
    r = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for k, c in enumerate(r.choices):
        prompt = prompts[k // 2]  # index = prompt * n + sample
        assert c.text.startswith(prompt)
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert c.text == prompt + alone.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_text_only_modalities_and_empty_web_search_are_accepted(srv: Server) -> None:
    ok = post(
        srv,
        "/chat/completions",
        {"messages": HI, "max_tokens": 2, "modalities": ["text"], "web_search_options": {}},
    )
    assert ok.status_code == 200, ok.text
    for extra in (
        {"modalities": ["text", "audio"]},
        {"web_search_options": {"search_context_size": "low"}},
    ):
        r = post(srv, "/chat/completions", {"messages": HI, "max_tokens": 2, **extra})
        assert r.status_code == 400 and next(iter(extra)) in r.json()["error"]["message"]


def _tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer", "enum": [1, 2]}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
    }


def test_allowed_tools_restrict_the_call(tools_server: Server) -> None:
    client = openai.OpenAI(base_url=tools_server.v1, api_key=TOOLS_KEY, max_retries=0)
    r = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "call something"}],
        max_tokens=200,
        temperature=1.0,
        seed=0,
        parallel_tool_calls=False,
        tools=[_tool("alpha"), _tool("beta"), _tool("gamma")],
        tool_choice={
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": "required",
                "tools": [{"type": "function", "function": {"name": "beta"}}],
            },
        },
        extra_body={"enable_thinking": False},
    )
    assert r.choices[0].finish_reason == "tool_calls", r
    calls = r.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"beta"}  # type: ignore[union-attr]
    # Only the allowed tool reaches the prompt: the other two are not rendered.
    everything = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "call something"}],
        max_tokens=1,
        tools=[_tool("alpha"), _tool("beta"), _tool("gamma")],
        extra_body={"enable_thinking": False},
    )
    assert r.usage is not None and everything.usage is not None
    assert r.usage.prompt_tokens < everything.usage.prompt_tokens
    bad = httpx.post(
        tools_server.v1 + "/chat/completions",
        headers={"Authorization": f"Bearer {TOOLS_KEY}"},
        json={
            "model": "tools",
            "messages": HI,
            "tools": [_tool("alpha")],
            "tool_choice": {
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "auto",
                    "tools": [{"type": "function", "function": {"name": "zeta"}}],
                },
            },
        },
        timeout=60,
    )
    assert bad.status_code == 400 and "zeta" in bad.json()["error"]["message"]
