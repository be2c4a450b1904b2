"""Isolation and containment (#13), gateway side: each test sends the hostile input
to a real server (real worker process, real sockets) and checks the status, that
other users' requests are served, and whether the worker was restarted.

- Poison requests: a request that kills every worker it reaches is dropped after
  two deaths (500 `request_crashed_worker`), its crashes do not spend the crash
  budget, and the model keeps serving.
- Recovery: a model FAILED by its crash budget starts again after its cool-down;
  meanwhile /startup, /ready and the model status say it is failed.
- Oversized IPC frames: an Add over the worker's frame limit is a 400 and never
  reaches the worker; schemas travel as UTF-8, not ASCII escapes.
- Request ids: two concurrent requests with one X-Request-ID both succeed, each
  with its own output.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from gateway.serving.grammars import compact_json, json_grammar
from protocol.worker_config import CRASH_SEED
from tests.helpers import (
    Server,
    greedy_chat_body,
    start_server,
    stop_server,
    wait_for,
)

BASE_ENV = {
    "MLXD_RESTART_BACKOFF_INITIAL_S": "0.1",
    "MLXD_TEST_FAULTS": "true",
    "MLXD_SSE_KEEPALIVE_S": "0",
}


def _tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def _stream_tokens(url: str, body: dict, headers: dict[str, str]) -> tuple[int, list[int], str]:
    ids: list[int] = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        echoed = r.headers.get("X-Request-ID", "")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice.get("token_ids") or []
        return r.status_code, ids, echoed


def _served(srv: Server) -> None:
    """Another user's request is served."""
    r = httpx.post(
        srv.v1 + "/chat/completions", json=greedy_chat_body("still serving?", 4), timeout=60
    )
    assert len(_tokens(r)) == 4


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A crash budget of 3: under the old rule (3 crashes per poison request) one
    # poison request would have left the model FAILED, and no cool-down saves it.
    env = {**BASE_ENV, "MLXD_RESTART_CRASH_BUDGET": "3", "MLXD_FAILED_RETRY_S": "0"}
    log = tmp_path_factory.mktemp("logs") / "isolation.log"
    server = start_server(str(tiny_model_dir), log, model_name="tiny", env=env)
    yield server
    stop_server(server)


# -- poison requests and the crash budget --------------------------------------------


def test_poison_requests_are_dropped_and_the_model_keeps_serving(srv: Server) -> None:
    before = srv.status()
    poison = greedy_chat_body("poison", 8, seed=CRASH_SEED)  # the worker dies on receiving it
    for stream in (False, True, False):
        r = httpx.post(srv.v1 + "/chat/completions", json={**poison, "stream": stream}, timeout=120)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "request_crashed_worker", err
        assert "crashed 2 times" in err["message"]
        wait_for(lambda: srv.status()["ready"], 60, "the model to be ready again")
        _served(srv)
    after = srv.status()
    # Each poison request cost exactly two worker deaths (one replay), and none of
    # them counted against the crash budget of 3: the model is ready, not FAILED.
    assert after["restarts"] - before["restarts"] == 6
    assert after["poisoned_requests"] - before["poisoned_requests"] == 3
    assert after["state"] == "ready" and after["retry_in_s"] is None
    assert httpx.get(srv.url + "/startup").status_code == 200
    lines = [json.loads(x) for x in srv.log().splitlines() if '"event": "request"' in x]
    dropped = [x for x in lines if x["status"] == 500 and "request_crashed_worker" in x["error"]]
    assert len(dropped) == 3


# -- oversized IPC frames --------------------------------------------------------------


def test_an_add_over_the_frame_limit_is_a_400_and_never_reaches_the_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A body limit above the IPC frame limit's half: a schema of quotes doubles
    # twice (JSON in JSON), so a 9 MB body would make an 18 MB Add.
    env = {**BASE_ENV, "MLXD_MAX_BODY_BYTES": str(12 * 1024 * 1024)}
    server = start_server(str(tiny_model_dir), tmp_path / "frames.log", model_name="tiny", env=env)
    try:
        pid = server.status()["worker_pid"]
        schema = {"type": "string", "description": '"' * 4_500_000}
        body = greedy_chat_body(
            "x",
            4,
            response_format={"type": "json_schema", "json_schema": {"name": "q", "schema": schema}},
        )
        with ThreadPoolExecutor(2) as pool:
            big = pool.submit(httpx.post, server.v1 + "/chat/completions", json=body, timeout=300)
            # Another user's request meanwhile.
            other = httpx.post(
                server.v1 + "/chat/completions", json=greedy_chat_body("hi", 4), timeout=120
            )
            r = big.result()
        assert len(_tokens(other)) == 4
        assert r.status_code == 400, r.text[:500]
        err = r.json()["error"]
        assert err["code"] == "request_too_large", err["message"][:300]
        assert "limit of 16777216" in err["message"]
        st = server.status()
        assert st["worker_pid"] == pid and st["restarts"] == 0  # nothing reached the worker
        _served(server)
    finally:
        stop_server(server)


def test_schemas_travel_as_utf8_not_ascii_escapes() -> None:
    n = 100_000
    grammar = json_grammar({"type": "string", "const": "é" * n})
    constraint = compact_json({"grammar": grammar}).encode()
    # 2 bytes per é in UTF-8; ASCII escapes made it 7 (\\u00e9 inside a string).
    assert 2 * n <= len(constraint) < 2 * n + 1000
    assert json.loads(json.loads(constraint)["grammar"])["grammars"][0]["json_schema"]["const"] == (
        "é" * n
    )


# -- request ids -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_shared_x_request_id_never_mixes_requests(srv: Server, stream: bool) -> None:
    pid = srv.status()["worker_pid"]
    prompts = ["the first user's prompt", "another user, another prompt entirely"]
    solo = [
        _tokens(httpx.post(srv.v1 + "/chat/completions", json=greedy_chat_body(p, 24), timeout=60))
        for p in prompts
    ]
    assert solo[0] != solo[1]
    headers = {"X-Request-ID": "same-label"}

    def one(p: str) -> tuple[int, list[int], str]:
        body = greedy_chat_body(p, 24, stream=stream)
        if stream:
            return _stream_tokens(srv.v1 + "/chat/completions", body, headers)
        r = httpx.post(srv.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
        return r.status_code, _tokens(r), r.headers["X-Request-ID"]

    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, prompts * 2))
        for (status, ids, echoed), want in zip(results, solo * 2, strict=True):
            assert status == 200 and echoed == "same-label"
            assert ids == want  # its own tokens, none of the other request's
    st = srv.status()
    assert st["worker_pid"] == pid and st["in_flight"] == 0
    lines = [
        json.loads(x) for x in srv.log().splitlines() if '"client_request_id": "same-label"' in x
    ]
    internal = {x["request_id"] for x in lines}
    assert len(lines) >= 12 and len(internal) == len(lines)  # one internal id each


# -- recovery ------------------------------------------------------------------------------


def test_a_step_out_of_device_memory_mid_stream_ends_neither_the_stream_nor_the_worker(
    srv: Server,
) -> None:
    """The worker's 5th step from now runs out of device memory (test fault): the
    stream that was decoding is recomputed and goes on to the same greedy text,
    in the same worker process, with nothing restarted."""
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
    body = greedy_chat_body("a stream through a full device", 24)
    extra = {k: body[k] for k in ("return_token_ids", "logit_bias")}

    def stream() -> tuple[str, str | None]:
        chunks = client.chat.completions.create(
            model="tiny",
            messages=body["messages"],
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        text, finish = "", None
        for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    expected = stream()
    before = srv.status()
    seen = before["worker"]["out_of_memory_steps"]
    r = httpx.post(srv.url + "/models/tiny/fault", json={"kind": "step_no_memory", "steps": 5})
    assert r.status_code == 202
    # The status call's stats request follows the fault on the worker's socket,
    # so once it is answered the fault is armed.
    assert srv.worker_stats()["out_of_memory_steps"] == seen
    assert stream() == expected
    after = srv.status()
    assert after["worker"]["out_of_memory_steps"] == seen + 1
    assert after["worker"]["governor"]["budget"] < before["worker"]["governor"]["budget"]
    assert after["worker"]["finish_reasons"].get("error", 0) == before["worker"][
        "finish_reasons"
    ].get("error", 0)
    assert (after["worker_pid"], after["restarts"]) == (before["worker_pid"], before["restarts"])
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert f'mlxd_worker_out_of_memory_steps_total{{model="tiny"}} {seen + 1}.0' in metrics
    _served(srv)


def test_a_malformed_step_fault_is_a_400_and_arms_nothing(srv: Server) -> None:
    seen = srv.worker_stats()["out_of_memory_steps"]
    for body in (
        {"kind": "step_no_memory", "steps": 0},
        {"kind": "step_no_memory", "steps": -3},
        {"kind": "step_no_memory", "steps": 10**7},
        {"kind": "step_no_memory", "steps": "many"},
        {"kind": "step_no_memory", "steps": [1]},
        {"kind": "out_of_memory"},
    ):
        r = httpx.post(srv.url + "/models/tiny/fault", json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    _served(srv)
    assert srv.worker_stats()["out_of_memory_steps"] == seen


def test_a_failed_model_starts_again_after_its_cool_down(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = {**BASE_ENV, "MLXD_RESTART_CRASH_BUDGET": "2", "MLXD_FAILED_RETRY_S": "2"}
    server = start_server(str(tiny_model_dir), tmp_path / "recover.log", model_name="tiny", env=env)
    try:
        url = server.url
        for n in (1, 2):
            pid = server.status()["worker_pid"]
            r = httpx.post(url + "/models/tiny/fault", json={"kind": "crash"})
            assert r.status_code == 202
            if n == 1:
                wait_for(
                    lambda pid=pid: (s := server.status())["ready"] and s["worker_pid"] != pid,
                    60,
                    "the first restart",
                )

        def failed() -> bool:
            return httpx.get(url + "/startup", timeout=5).status_code == 503

        wait_for(failed, 60, "the FAILED state")
        startup = httpx.get(url + "/startup").json()
        assert startup["status"] == "failed" and "crashes" in startup["reason"]
        assert startup["retry_in_s"] is not None
        status = server.status()
        assert status["state"] == "failed" and status["retry_in_s"] is not None
        assert httpx.get(url + "/ready").status_code == 503
        assert httpx.get(url + "/live").status_code == 200
        r = httpx.post(
            url + "/v1/chat/completions", json=greedy_chat_body("while failed", 2), timeout=30
        )
        assert r.status_code == 503 and "next start attempt" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
        # After the cool-down the model starts again, and serves.
        wait_for(lambda: httpx.get(url + "/ready").status_code == 200, 120, "recovery")
        assert httpx.get(url + "/startup").status_code == 200
        status = server.status()
        assert status["state"] == "ready" and status["retry_in_s"] is None
        _served(server)
    finally:
        stop_server(server)


# -- slow clients ------------------------------------------------------------------------

KEY = "slow-client-test-key"
CAP = 8


@pytest.fixture(scope="module")
def slow(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        **BASE_ENV,
        "MLXD_API_KEYS": json.dumps([KEY]),
        "MLXD_HEADER_TIMEOUT_S": "1",
        "MLXD_BODY_TIMEOUT_S": "1",
        "MLXD_BODY_MIN_BYTES_PER_S": "1000",
        "MLXD_MAX_CONNECTIONS": str(CAP),
    }
    log = tmp_path_factory.mktemp("logs") / "slow.log"
    server = start_server(str(tiny_model_dir), log, model_name="tiny", env=env)
    yield server
    stop_server(server)


def _connect(srv: Server) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    return s


def _until_eof(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's
    30 s timeout only guards against a hang: the server's limits are 1 s)."""
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    s.close()
    return got


def _authorizedgreedy_chat_body(srv: Server) -> None:
    r = httpx.post(
        srv.v1 + "/chat/completions",
        json=greedy_chat_body("a patient user", 4),
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert len(_tokens(r)) == 4


def _gateway_fds(srv: Server) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


@pytest.mark.parametrize("auth", [True, False])
def test_slow_clients_are_cut_off(slow: Server, auth: bool) -> None:
    header = f"Authorization: Bearer {KEY}\r\n" if auth else ""
    partial_headers = _connect(slow)
    partial_headers.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + header.encode())
    short_body = _connect(slow)
    short_body.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + header.encode()
        + b"Content-Length: 1000\r\n\r\n{"
    )
    chunked = _connect(slow)
    chunked.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + header.encode()
        + b"Transfer-Encoding: chunked\r\n\r\n"
    )
    stop = threading.Event()

    def trickle() -> None:  # a chunk of one byte every 50 ms, forever
        with contextlib.suppress(OSError):
            while not stop.wait(0.05):
                chunked.sendall(b"1\r\n \r\n")

    dripper = threading.Thread(target=trickle, daemon=True)
    dripper.start()
    try:
        # Another user is served meanwhile.
        _authorizedgreedy_chat_body(slow)
        assert _until_eof(partial_headers) == b""  # closed without an answer
        answer = _until_eof(short_body)
        want = b"HTTP/1.1 408" if auth else b"HTTP/1.1 401"
        assert answer.startswith(want), answer[:200]
        answer = _until_eof(chunked)
        assert answer.startswith(want), answer[:200]
    finally:
        stop.set()
        dripper.join()
    _authorizedgreedy_chat_body(slow)


def test_connections_past_the_cap_are_closed_at_once(slow: Server) -> None:
    baseline = _gateway_fds(slow)
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:  # the gateway's descriptors while the connections are open
        while not done.wait(0.005):
            peak.append(_gateway_fds(slow))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    idle = [_connect(slow) for _ in range(3 * CAP)]
    for s in idle:
        with contextlib.suppress(OSError):  # a refused one may be closed already
            s.sendall(b"GET /live HTTP/1.1\r\n")  # headers that never end
    try:
        assert all(_until_eof(s) == b"" for s in idle)  # each closed: by the cap or the timeout
    finally:
        done.set()
        sampler.join()
    # The gateway never held more than CAP of them (+1: the one being refused).
    assert max(peak) <= baseline + CAP + 1, (baseline, max(peak))
    assert "connection cap (8) reached" in slow.log()
    _authorizedgreedy_chat_body(slow)
    assert httpx.get(slow.url + "/live").status_code == 200


# -- cheap requests that stall everyone -------------------------------------------------


def test_big_bodies_do_not_stall_other_users(srv: Server) -> None:
    pid = srv.status()["worker_pid"]
    big = "lorem ipsum dolor sit amet, " * 60_000  # 1.7 MB of text to tokenize: seconds
    finished: list[tuple[str, float]] = []  # (what, when): the order things ended in
    lock = threading.Lock()

    def done(what: str) -> None:
        with lock:
            finished.append((what, time.monotonic()))

    def count(i: int) -> int:
        # Each its own text (a different first word): identical ones would reuse the
        # first's tokens (gateway/serving/prompt_tokens.py) and all end with it, and
        # in a fresh-clone CI run that window closed before the first poll below.
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"{i} {big}"}]}
        r = httpx.post(srv.v1 + "/messages/count_tokens", json=body, timeout=300)
        done("count_tokens")
        assert r.status_code == 200, r.text[:300]
        return int(r.json()["input_tokens"])

    def refused(body: dict) -> httpx.Response:
        r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=300)
        done("refused")
        return r

    # 8 MB and 5 MB of small values: parsing them alone held the event loop 0.2-0.6 s.
    many_messages = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 200_000}
    huge_bias = {**greedy_chat_body("hi", 2), "logit_bias": {str(i): 1 for i in range(400_000)}}
    with ThreadPoolExecutor(8) as pool:
        counts = [pool.submit(count, i) for i in range(3)]
        shapes = [pool.submit(refused, many_messages), pool.submit(refused, huge_bias)]
        # Wait until the counts hold the tokenizer (the gateway says so: in flight).
        wait_for(lambda: srv.status()["queue"]["in_flight"] >= 1, 60, "the counts to start")
        live = httpx.get(srv.url + "/live", timeout=30)
        done("live")
        r = httpx.post(srv.v1 + "/chat/completions", json=greedy_chat_body("small", 4), timeout=300)
        done("small chat")
        assert len(_tokens(r)) == 4
        assert live.status_code == 200
        # Every count is right: the same, as the texts' first words are one token each.
        assert len({c.result() for c in counts}) == 1
        for f in shapes:  # refused by the helper process, before the loop parses them
            r = f.result()
            assert r.status_code == 400, r.text[:300]
            assert "more than 200000 JSON values" in r.json()["error"]["message"]
    order = [what for what, _ in sorted(finished, key=lambda x: x[1])]
    # The small chat and /live were answered while the big counts were still being
    # tokenized: they did not queue behind them for the tokenizer's threads (with
    # FIFO threads the chat waited for the first two counts). The first count may
    # end first: it held its thread before the poll above saw it, and in a loaded
    # fresh-clone CI run it once finished before the chat's reply came back.
    counts_done = [i for i, what in enumerate(order) if what == "count_tokens"]
    assert order.index("small chat") < counts_done[1], order
    assert order.index("live") < order.index("small chat"), order
    assert order[-1] == "count_tokens", order
    assert srv.status()["worker_pid"] == pid


# -- logs --------------------------------------------------------------------------------


def test_logs_are_bounded_and_carry_no_text(srv: Server) -> None:
    secret = "prompt-text-that-must-never-be-logged-7f3a"
    name = "m" * 7_000_000
    r = httpx.post(
        srv.v1 + "/chat/completions",
        json={**greedy_chat_body(secret), "model": name},
        headers={"X-Request-ID": "huge-model-name"},
        timeout=120,
    )
    assert r.status_code == 404
    r = httpx.post(
        srv.v1 + "/chat/completions",
        json=greedy_chat_body(secret, 8),
        headers={"X-Request-ID": "log-no-text"},
        timeout=60,
    )
    assert len(_tokens(r)) == 8
    output = r.json()["choices"][0]["message"]["content"]
    _served(srv)
    log = srv.log()
    line = next(x for x in log.splitlines() if '"client_request_id": "huge-model-name"' in x)
    assert len(line) < 2000, len(line)  # the 7 MB name, twice, was 14 MB
    assert json.loads(line)["status"] == 404
    assert max(len(x) for x in log.splitlines()) < 5000
    assert secret not in log
    assert len(output) < 8 or output not in log


def test_body_shape_bounds_apply_below_the_helper_threshold(srv: Server) -> None:
    cases = {
        "messages": {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 10_001},
        "logit_bias": {**greedy_chat_body("hi", 2), "logit_bias": {str(i): 1 for i in range(1025)}},
    }
    for field, body in cases.items():
        r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]
    _served(srv)
