"""Probes follow the worker's real state; timeouts and SSE keep-alives through real HTTP.

One server, watched from the moment its process starts: /startup and /ready are
503 while the model loads and 200 after. Then the worker process is frozen
(SIGSTOP) and killed (SIGKILL) underneath the gateway: /live keeps answering,
/ready reports it. While the worker is frozen, requests hit their deadline and
end cleanly (504, or an SSE error event after keep-alive comments).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, Server, assert_serving, free_port, stop_server, wait_for

TIMEOUT_S = 2.0
KEEPALIVE_S = 0.2


@pytest.fixture(scope="module")
def boot(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Start a server and record what the probes said until it was ready."""
    log_path = tmp_path_factory.mktemp("probes") / "server.log"
    port = free_port()
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        MLXD_REQUEST_TIMEOUT_S=str(TIMEOUT_S),
        MLXD_SSE_KEEPALIVE_S=str(KEEPALIVE_S),
    )
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--model",
                str(tiny_model_dir),
                "--model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    seen: list[tuple[int, int, int, dict, dict]] = []  # live, startup, ready, bodies
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                live = httpx.get(url + "/live", timeout=2)
                # /ready first: once it is 200, /startup must be too.
                rd = httpx.get(url + "/ready", timeout=2)
                st = httpx.get(url + "/startup", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            seen.append((live.status_code, st.status_code, rd.status_code, st.json(), rd.json()))
            if rd.status_code == 200:
                break
            time.sleep(0.02)
        srv = Server(url, proc, "tiny", log_path)
        yield {"server": srv, "seen": seen}
    finally:
        if proc.poll() is None:
            stop_server(Server(url, proc, "tiny", log_path))


def worker_pid(srv: Server) -> int:
    return int(srv.status()["worker_pid"])


def chat(srv: Server, max_tokens: int = 3, **kw: object) -> httpx.Response:
    return httpx.post(
        f"{srv.v1}/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **kw,
        },
        timeout=60,
    )


def wait_for_status(srv: Server, path: str, status: int, within: float) -> dict:
    """GET `path` until it answers `status`; its body."""
    answers: list[httpx.Response] = []

    def answered() -> bool:
        answers.append(httpx.get(srv.url + path, timeout=5))
        return answers[-1].status_code == status

    wait_for(answered, within, f"{path} to answer {status}")
    return answers[-1].json()


def assert_live(srv: Server) -> None:
    r = httpx.get(srv.url + "/live", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_startup_and_ready_follow_the_model_load(boot: dict) -> None:
    seen = boot["seen"]
    # The gateway answers /live at once, long before the model is loaded.
    assert all(live == 200 for live, *_ in seen)
    loading = [(st, rd, sb, rb) for _, st, rd, sb, rb in seen if rd == 503]
    assert loading, "never saw the model loading"
    for st, _rd, sb, rb in loading:
        assert rb["status"] == "not_ready" and rb["reason"]
        if st == 503:
            assert sb["status"] == "starting"
            assert sb["phase"] in ("loading_model", "loading_tokenizer", "starting")
    assert seen[0][1] == 503  # /startup was 503 at first...
    _, st, rd, sb, rb = seen[-1]
    assert (st, rd) == (200, 200)  # ...and 200 with /ready once loaded
    assert sb["status"] == "started" and sb["startup_s"] > 0
    assert rb == {"status": "ready", "model": "tiny"}


def test_timeouts_and_keepalives_while_the_worker_is_frozen(boot: dict) -> None:
    srv = boot["server"]
    assert_serving(srv)
    pid = worker_pid(srv)
    results: dict[str, object] = {}

    def streamed() -> None:
        lines: list[str] = []
        with httpx.stream(
            "POST",
            f"{srv.v1}/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 50,
                "stream": True,
            },
            timeout=30,
        ) as r:
            results["stream_status"] = r.status_code
            lines.extend(x for x in r.iter_lines() if x)
        results["stream"] = lines

    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        th = threading.Thread(target=streamed)
        th.start()
        r = chat(srv, 50)
        elapsed = time.monotonic() - t0
        assert_live(srv)  # while the worker is still frozen
        th.join(20)
    finally:
        os.kill(pid, signal.SIGCONT)
    # Non-streaming: a clean 504 at the deadline.
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "timeout" and err["type"] == "timeout_error"
    assert elapsed >= TIMEOUT_S - 0.1  # at the deadline, not before (only it can end a frozen call)
    # Streaming: keep-alive comments while no token came, then the error event and [DONE].
    assert results["stream_status"] == 200
    lines = results["stream"]
    assert isinstance(lines, list)
    comments = [x for x in lines if x.startswith(":")]
    assert len(comments) >= 3, lines
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "timeout"
    # The worker serves again; the timed-out requests were aborted, not leaked.
    wait_for_status(srv, "/ready", 200, 30)
    assert_serving(srv)
    log = [json.loads(x) for x in srv.log().splitlines() if '"event": "request"' in x]
    timed_out = [x for x in log if x["finish_reason"] == "timeout"]
    assert len(timed_out) == 2 and all(x["error"] for x in timed_out)


def test_ready_goes_false_while_the_worker_is_stopped(boot: dict) -> None:
    srv = boot["server"]
    pid = worker_pid(srv)
    os.kill(pid, signal.SIGSTOP)
    try:
        body = wait_for_status(srv, "/ready", 503, 30)
        assert body["status"] == "not_ready" and body["reason"]
        assert_live(srv)  # while the worker is still frozen
        assert httpx.get(srv.url + "/startup").status_code == 200  # startup stays done
        assert httpx.get(srv.url + "/models/tiny/ready").status_code == 503
    finally:
        # The supervisor may have killed the frozen worker already.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    # Back to ready: the same worker resumed, or the supervisor replaced it.
    wait_for_status(srv, "/ready", 200, 60)
    assert_serving(srv)


def test_ready_goes_false_when_the_worker_dies(boot: dict) -> None:
    srv = boot["server"]
    pid = worker_pid(srv)
    os.kill(pid, signal.SIGKILL)
    body = wait_for_status(srv, "/ready", 503, 10)
    assert body["reason"]
    assert_live(srv)
    assert httpx.get(srv.url + "/startup").status_code == 200
    metrics = httpx.get(srv.url + "/metrics").text
    assert "mlxd_ready" in metrics
