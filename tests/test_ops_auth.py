"""Auth, rate limits, body and token caps through real HTTP; keys never reach the logs.

One server with keys of each scope (from MLXD_API_KEYS and --api-key), a per-key
rate limit and small request caps. Every refused request is followed by a check
that the worker still serves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.http.auth import required_scope
from tests.helpers import Server, assert_serving, start_server, stop_server

INFERENCE = "sk-inference-0123456789"
ADMIN = "sk-admin-0123456789"
LIMITED = "sk-limited-0123456789"
FULL = "sk-full-from-cli-0123456789"
WRONG = "sk-wrong-0123456789"
ALL_KEYS = (INFERENCE, ADMIN, LIMITED, FULL, WRONG)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = [
        {"key": INFERENCE, "scopes": ["inference"], "name": "app"},
        {"key": ADMIN, "scopes": ["admin"], "name": "ops"},
        {"key": LIMITED, "scopes": ["inference"], "name": "limited", "rate_limit_rpm": 6},
    ]
    s = start_server(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("auth") / "server.log",
        model_name="tiny",
        env={
            "MLXD_API_KEYS": json.dumps(keys),
            "MLXD_RATE_LIMIT_BURST": "2",
            "MLXD_MAX_BODY_BYTES": "4096",
            "MLXD_MAX_PROMPT_TOKENS": "64",
            "MLXD_MAX_TOKENS_LIMIT": "32",
        },
        extra_args=["--api-key", FULL],
    )
    yield s
    stop_server(s)


def chat(srv: Server, key: str | None, max_tokens: int = 3, **kw: object) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    body.update(kw)
    return httpx.post(
        f"{srv.v1}/chat/completions", json=body, headers=bearer(key) if key else {}, timeout=60
    )


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


def test_route_scopes() -> None:
    assert required_scope("/live") is None
    assert required_scope("/ready") is None
    assert required_scope("/models/tiny/ready") is None
    assert required_scope("/models/tiny/status") == "admin"
    assert required_scope("/models/a/b/ready") == "admin"
    assert required_scope("/metrics") == "admin"
    assert required_scope("/v1/chat/completions") == "inference"
    assert required_scope("/v1/models") == "inference"


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        (bearer(WRONG), "invalid_api_key"),
        ({"Authorization": f"Basic {INFERENCE}"}, "missing_api_key"),
        ({"Authorization": "Bearer"}, "missing_api_key"),
        (bearer(INFERENCE + "x"), "invalid_api_key"),
        (bearer(INFERENCE[:-1]), "invalid_api_key"),
    ],
    ids=["none", "wrong", "basic", "empty", "longer", "prefix"],
)
def test_missing_or_wrong_key_is_401(srv: Server, headers: dict, code: str) -> None:
    r = httpx.post(
        f"{srv.v1}/chat/completions",
        headers=headers,
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
    )
    err = assert_error(r, 401, code)
    assert err["type"] == "authentication_error"
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert r.headers["X-Request-ID"]


def test_openai_sdk_with_keys(srv: Server) -> None:
    ok = openai.OpenAI(base_url=srv.v1, api_key=INFERENCE, max_retries=0)
    r = ok.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, temperature=0
    )
    assert r.usage is not None and r.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=srv.v1, api_key=WRONG, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert_serving(srv, headers=bearer(INFERENCE), admin_headers=bearer(ADMIN))


def test_scopes(srv: Server) -> None:
    u = srv.url
    assert_error(chat(srv, ADMIN), 403, "insufficient_scope")
    assert chat(srv, FULL).status_code == 200
    for path in ("/metrics", "/models", "/models/tiny/status", "/version"):
        assert_error(httpx.get(u + path, headers=bearer(INFERENCE)), 403, "insufficient_scope")
        assert_error(httpx.get(u + path), 401, "missing_api_key")
        assert httpx.get(u + path, headers=bearer(ADMIN)).status_code == 200, path
        assert httpx.get(u + path, headers=bearer(FULL)).status_code == 200, path
    # Probes never need a key.
    for path in ("/live", "/startup", "/ready", "/health", "/models/tiny/ready"):
        assert httpx.get(u + path).status_code == 200, path
    assert_serving(srv, headers=bearer(INFERENCE), admin_headers=bearer(ADMIN))


def test_rate_limit_is_429_with_retry_after(srv: Server) -> None:
    assert chat(srv, LIMITED).status_code == 200
    assert chat(srv, LIMITED).status_code == 200
    r = chat(srv, LIMITED)
    err = assert_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_error"
    retry = int(r.headers["Retry-After"])
    assert 1 <= retry <= 10  # 6 per minute: one token every 10 s
    assert chat(srv, INFERENCE).status_code == 200  # other keys are not limited
    metrics = httpx.get(srv.url + "/metrics", headers=bearer(ADMIN)).text
    assert 'mlxd_admission_rejections_total{model="",reason="rate_limited"} 1.0' in metrics
    assert_serving(srv, headers=bearer(INFERENCE), admin_headers=bearer(ADMIN))


def test_body_over_the_limit_is_413(srv: Server) -> None:
    big = "x" * 5000
    r = chat(srv, INFERENCE, messages=[{"role": "user", "content": big}])
    err = assert_error(r, 413)
    assert "4096" in err["message"]
    # Authentication comes first: without a key the body is never read.
    assert_error(chat(srv, None, messages=[{"role": "user", "content": big}]), 401)
    assert_serving(srv, headers=bearer(INFERENCE), admin_headers=bearer(ADMIN))


def test_prompt_and_max_tokens_caps_are_400(srv: Server) -> None:
    long_prompt = "word " * 200  # well over 64 tokens, well under 4096 bytes
    err = assert_error(
        chat(srv, INFERENCE, messages=[{"role": "user", "content": long_prompt}]),
        400,
        "context_length_exceeded",
    )
    assert "64" in err["message"]
    r = httpx.post(
        f"{srv.v1}/completions",
        headers=bearer(INFERENCE),
        timeout=30,
        json={"model": "tiny", "prompt": list(range(1, 80)), "max_tokens": 2},
    )
    assert_error(r, 400, "context_length_exceeded")
    err = assert_error(chat(srv, INFERENCE, max_tokens=33), 400)
    assert err["param"] == "max_tokens" and "32" in err["message"]
    assert chat(srv, INFERENCE, max_tokens=32).status_code == 200
    assert_serving(srv, headers=bearer(INFERENCE), admin_headers=bearer(ADMIN))


def test_no_key_in_any_log_line(srv: Server) -> None:
    # Present every key, right and wrong, on several routes; then read everything
    # the gateway and the worker logged.
    for key in ALL_KEYS:
        chat(srv, key)
        httpx.get(srv.url + "/metrics", headers=bearer(key))
        httpx.get(srv.url + "/nope", headers=bearer(key))
    log = srv.log()
    for key in ALL_KEYS:
        assert key not in log
        assert key[3:] not in log
    request_lines = [json.loads(x) for x in log.splitlines() if x.startswith('{"request_id"')]
    assert request_lines
    labels = {x["key_name"] for x in request_lines}
    assert {"app", "ops", "cli-1"} <= labels
