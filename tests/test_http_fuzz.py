"""HTTP fuzzing: schemathesis against the running server, and hand-written hostile inputs.

Every operation of the OpenAPI description (gateway/http/openapi.py) is fuzzed with
schemathesis, from schema-valid (positive) and, for request bodies, invalid
(negative) inputs, a bounded number of examples each. What must hold for every
response: no 5xx but the documented 503s, the status, content type and body
match the description, and every error is an OpenAI error object (Anthropic's
route: Anthropic's error shape). Afterwards the worker still serves and holds
no request.

The server caps max_tokens (8) so that the valid requests the fuzzer finds
generate a few tokens only. MLXD_FUZZ_EXAMPLES=N sets the examples per POST
operation and mode (default 20, about 40 s here); raise it for a deeper run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.http.openapi import build_spec
from tests.helpers import Server, start_server, stop_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MODEL = "tiny"
FUZZ_ENV = {
    "MLXD_MAX_TOKENS_LIMIT": "8",
    "MLXD_DEFAULT_MAX_TOKENS": "4",
    "MLXD_REQUEST_TIMEOUT_S": "60",
    "MLXD_MAX_QUEUED": "256",
}
POST_EXAMPLES = int(os.environ.get("MLXD_FUZZ_EXAMPLES", "20"))  # per operation and mode
GET_EXAMPLES = max(4, POST_EXAMPLES // 3)
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("fuzz") / "server.log",
        model_name=MODEL,
        env=FUZZ_ENV,
    )
    yield srv
    stop_server(srv)


def _cases() -> list[tuple[str, str, GenerationMode]]:
    cases = []
    for path, item in build_spec(test_faults=False)["paths"].items():
        for method, op in item.items():
            cases.append((path, method, GenerationMode.POSITIVE))
            if "requestBody" in op:  # nothing else can be made invalid
                cases.append((path, method, GenerationMode.NEGATIVE))
    return cases


def assert_error_object(path: str, status: int, body: Any) -> None:
    """An error response is an OpenAI error object (or Anthropic's, on /v1/messages)."""
    assert isinstance(body, dict), body
    if path.startswith("/v1/messages") and body.get("type") == "error":
        assert set(body["error"]) == {"type", "message"}, body
        return
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == OPENAI_ERROR_KEYS, body
    assert isinstance(err["message"], str) and err["message"], body
    assert "Traceback" not in err["message"]


def _check(path: str, response: Any) -> None:
    status = response.status_code
    # 503 is documented (queue full, model not ready); any other 5xx is a bug.
    assert status < 500 or status == 503, f"{status}: {response.text[:500]}"
    if status >= 400:
        ctype = {k.lower(): v for k, v in response.headers.items()}.get("content-type")
        assert ctype and "application/json" in str(ctype), response.headers
        assert_error_object(path, status, response.json())


@pytest.mark.parametrize(
    ("path", "method", "mode"),
    _cases(),
    ids=[f"{m} {p} {g.value}" for p, m, g in _cases()],
)
def test_schemathesis(fuzz_server: Server, path: str, method: str, mode: GenerationMode) -> None:
    import requests

    spec = json.loads(httpx.get(fuzz_server.url + "/openapi.json", timeout=10).text)
    operation = schemathesis.openapi.from_dict(spec)[path][method.upper()]
    session = requests.Session()
    examples = POST_EXAMPLES if method == "post" else GET_EXAMPLES

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same inputs on every run: a failure reproduces
    )
    @given(case=operation.as_strategy(generation_mode=mode), served=st.booleans())
    def run(case: Any, served: bool) -> None:
        # Half the requests name the served model, so they get past the model check.
        if served and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        if served and case.path_parameters and "model" in case.path_parameters:
            case.path_parameters["model"] = MODEL
        response = case.call(base_url=fuzz_server.url, session=session, timeout=60)
        _check(path, response)
        case.validate_response(
            response,
            checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
        )

    try:
        run()
    finally:
        session.close()


# -- hand-written hostile inputs --------------------------------------------------------


def _chat(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    body.update(over)
    return body


def _raw(text: bytes) -> dict[str, Any]:
    return {"content": text, "headers": {"Content-Type": "application/json"}}


def _raw_chat(extra: bytes = b"", content: bytes = b"x") -> dict[str, Any]:
    """A chat body as raw bytes, for what json.dumps cannot write (bad UTF-8, NaN, ...)."""
    msgs = b'"messages": [{"role": "user", "content": "' + content + b'"}]'
    return _raw(b'{"model": "tiny", "max_tokens": 2, ' + msgs + extra + b"}")


def _msg(content: Any, role: Any = "user") -> dict[str, Any]:
    return {"json": _chat(messages=[{"role": role, "content": content}])}


def _text(prompt: Any, max_tokens: int = 2) -> dict[str, Any]:
    return {"json": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}}


CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
SPECIALS = "<|im_start|><|im_end|><|endoftext|>"
HOSTILE: list[tuple[str, str, dict[str, Any], int]] = [
    ("invalid utf-8", CHAT, _raw_chat(content=b"\xff\xfe"), 400),
    ("lone surrogate in content", CHAT, _raw_chat(content=b"a\\ud800b"), 400),
    ("lone surrogate prompt", TEXT, _raw(b'{"model": "tiny", "prompt": "\\udfff"}'), 400),
    ("surrogate pair is fine", CHAT, _raw_chat(content=b"\\ud83d\\ude00"), 200),
    ("deeply nested body", CHAT, _raw(b"[" * 100_000 + b"]" * 100_000), 400),
    ("deeply nested object", CHAT, _raw(b'{"a":' * 5000 + b"1" + b"}" * 5000), 400),
    ("nested unknown field", CHAT, _raw_chat(b', "metadata": ' + b"[" * 900 + b"]" * 900), 200),
    ("huge max_tokens", CHAT, {"json": _chat(max_tokens=10**30)}, 400),
    ("max_tokens 1e999", CHAT, _raw_chat(b', "max_completion_tokens": 1e999'), 400),
    ("5000-digit number", CHAT, _raw_chat(b', "seed": ' + b"9" * 5000), 400),
    ("huge top_k", CHAT, {"json": _chat(top_k=10**30)}, 400),
    ("huge seed", CHAT, {"json": _chat(seed=10**30)}, 400),
    ("huge logit_bias id", CHAT, {"json": _chat(logit_bias={"9" * 40: 1})}, 400),
    ("NaN temperature", CHAT, _raw_chat(b', "temperature": NaN'), 400),
    ("Infinity penalty", CHAT, _raw_chat(b', "presence_penalty": Infinity'), 400),
    ("NaN logit bias", CHAT, _raw_chat(b', "logit_bias": {"5": NaN}'), 400),
    ("negative max_tokens", CHAT, {"json": _chat(max_tokens=-1)}, 400),
    ("zero max_tokens", CHAT, {"json": _chat(max_tokens=0)}, 400),
    ("zero max_completion_tokens", CHAT, {"json": _chat(max_completion_tokens=0)}, 400),
    ("zero max_tokens completion", TEXT, _text("x", max_tokens=0), 400),
    ("empty messages", CHAT, {"json": _chat(messages=[])}, 400),
    ("unknown role", CHAT, _msg("x", role="wizard"), 400),
    ("role not a string", CHAT, _msg("x", role=5), 400),
    ("message not an object", CHAT, {"json": _chat(messages=["hi"])}, 400),
    ("content a number", CHAT, _msg(5), 400),
    ("content an object", CHAT, _msg({"a": 1}), 400),
    ("content part a number", CHAT, _msg([5]), 400),
    ("content part text a number", CHAT, _msg([{"type": "text", "text": 5}]), 400),
    ("content part without text", CHAT, _msg([{"type": "text"}]), 400),
    ("10,000 stop strings", CHAT, {"json": _chat(stop=[f"s{i}" for i in range(10_000)])}, 400),
    ("NUL bytes in content", CHAT, _msg("a\x00b\x00"), 200),
    ("raw NUL byte in JSON", CHAT, _raw_chat(content=b"a\x00b"), 400),
    ("NUL in model", CHAT, {"json": _chat(model="ti\x00ny")}, 404),
    ("NUL stop string", CHAT, {"json": _chat(stop=["\x00"])}, 200),
    ("only special tokens (chat)", CHAT, _msg(SPECIALS), 200),
    ("only special tokens (text)", TEXT, _text(SPECIALS, max_tokens=4), 200),
    ("only special token ids", TEXT, _text([0, 1, 2, 0, 1, 2], max_tokens=4), 200),
    ("token id out of range", TEXT, _text([2**70]), 400),
    ("empty prompt", TEXT, _text(""), 400),
]


@pytest.mark.parametrize(("name", "path", "kw", "status"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input(fuzz_server: Server, name: str, path: str, kw: dict, status: int) -> None:
    for stream in (False, True):
        if stream and "json" not in kw:
            continue
        req = dict(kw)
        if stream:
            req["json"] = {**kw["json"], "stream": True}
        r = httpx.post(fuzz_server.url + path, timeout=60, **req)
        assert r.status_code == status, r.text
        if status >= 400:
            assert_error_object(path, status, r.json())
        elif stream:
            events = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]", r.text
            assert not any('"error"' in e for e in events), r.text
        else:
            assert r.json()["usage"]["completion_tokens"] >= 1


def test_stop_string_longer_than_the_output(fuzz_server: Server) -> None:
    plain = httpx.post(fuzz_server.v1 + "/chat/completions", json=_chat(max_tokens=8), timeout=60)
    expected = plain.json()["choices"][0]["message"]["content"]
    long_stop = "\u00e9" + "x" * 5000  # longer than anything 8 tokens can spell
    r = httpx.post(
        fuzz_server.v1 + "/chat/completions", json=_chat(max_tokens=8, stop=[long_stop]), timeout=60
    )
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == expected  # held back while it could match, then sent
    assert choice["finish_reason"] == "length"
    streamed = ""
    with httpx.stream(
        "POST",
        fuzz_server.v1 + "/chat/completions",
        json=_chat(max_tokens=8, stop=[long_stop], stream=True),
        timeout=60,
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                streamed += chunk["choices"][0]["delta"].get("content") or ""
    assert streamed == expected


def test_worker_still_serves_after_the_fuzzing(fuzz_server: Server) -> None:
    r = httpx.post(fuzz_server.v1 + "/chat/completions", json=_chat(max_tokens=3), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    status = fuzz_server.status()
    # A restart's cause is in the gateway's warnings (the supervisor says why it
    # restarted): the failure message carries them, since CI keeps no server log.
    warnings = [
        line
        for line in fuzz_server.log().splitlines()
        if '"level": "warning"' in line or '"level": "error"' in line
    ]
    assert status["restarts"] == 0 and status["ready"], (status, warnings[-8:])
    assert status["worker"]["requests"] == 0 and status["worker"]["batch_rows"] == 0
    assert status["queue"]["in_flight"] == 0 and status["queue"]["queued"] == 0
    assert "Traceback" not in fuzz_server.log()
