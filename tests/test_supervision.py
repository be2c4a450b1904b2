"""Chaos tests on the real processes: crash, wedge, failed load, gateway death, drain."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from protocol import exit_codes
from protocol.worker_config import LOAD_NO_MEMORY_ENV
from tests.helpers import Server, greedy_chat_body, start_server, stop_server

FAST_RESTART = {
    "MLXD_RESTART_BACKOFF_INITIAL_S": "0.1",
    "MLXD_WATCHDOG_S": "2",
    "MLXD_TEST_FAULTS": "true",
    "MLXD_PREFILL_CHUNK": "256",
    "MLXD_MAX_IN_FLIGHT": "16",
    "MLXD_MAX_QUEUED": "64",
}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of a dead gateway is reaped by init; treat zombies as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    """Poll a condition of another process (no event crosses the process boundary)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _ready(server: Server) -> int:
    try:
        return httpx.get(server.url + "/ready", timeout=2).status_code
    except httpx.TransportError:
        return 0


@pytest.fixture
def chaos_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    srv = start_server(
        str(tiny_model_dir), tmp_path / "server.log", model_name="tiny", env=FAST_RESTART
    )
    yield srv
    stop_server(srv)


class LiveProbe:
    """Polls /live from a thread for the whole test; records any failure."""

    def __init__(self, server: Server) -> None:
        self.failures: list[str] = []
        self.ready_seen: list[int] = []
        self._stop = threading.Event()
        self._server = server
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as c:
            while not self._stop.wait(0.02):
                try:
                    r = c.get(self._server.url + "/live")
                    if r.status_code != 200:
                        self.failures.append(f"status {r.status_code}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.ready_seen.append(_ready(self._server))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_sigkill_worker_replays_undelivered_requests(chaos_server: Server) -> None:
    srv = chaos_server
    prompts = [f"chaos prompt number {i}" for i in range(24)]
    expected = {}
    for i, p in enumerate(prompts):
        if i % 3 != 1:  # solo greedy reference for everything that must complete
            r = httpx.post(srv.v1 + "/chat/completions", json=greedy_chat_body(p, 60), timeout=60)
            expected[i] = r.json()["choices"][0]["token_ids"]
    probe = LiveProbe(srv)
    first_data = threading.Barrier(9)  # 8 streams + the killer

    def non_streaming(i: int) -> tuple[int, dict]:
        r = httpx.post(
            srv.v1 + "/chat/completions", json=greedy_chat_body(prompts[i], 60), timeout=120
        )
        return r.status_code, r.json()

    def streaming(i: int) -> list[str]:
        events = []
        waited = False
        with httpx.stream(
            "POST",
            srv.v1 + "/chat/completions",
            json=greedy_chat_body(prompts[i], 3000, stream=True),
            timeout=120,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if not waited:
                        waited = True
                        first_data.wait(60)
        return events

    worker_pid = srv.status()["worker_pid"]
    with ThreadPoolExecutor(24) as pool:
        streams = [pool.submit(streaming, i) for i in range(1, 24, 3)]  # 8 streaming
        plain = [pool.submit(non_streaming, i) for i in range(0, 24, 3)]  # 8 in flight
        first_data.wait(60)  # every stream has sent bytes to its client
        queued = [pool.submit(non_streaming, i) for i in range(2, 24, 3)]  # 8 more
        os.kill(worker_pid, signal.SIGKILL)
        plain_results = [f.result(timeout=120) for f in plain + queued]
        stream_results = [f.result(timeout=120) for f in streams]
    probe.stop()

    indices = list(range(0, 24, 3)) + list(range(2, 24, 3))
    for i, (status, body) in zip(indices, plain_results, strict=True):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == expected[i], f"request {i} differs"
    for events in stream_results:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "error" in last and "worker" in last["error"]["message"]
    assert not probe.failures, probe.failures[:3]
    assert 503 in probe.ready_seen and probe.ready_seen[-1] == 200
    status = srv.status()
    assert status["worker_pid"] != worker_pid
    assert status["restarts"] >= 1
    assert "SIGKILL" in srv.log()
    assert "worker_restarted" in srv.log()


def test_wedged_worker_is_detected_and_restarted(chaos_server: Server) -> None:
    srv = chaos_server
    expected = httpx.post(
        srv.v1 + "/chat/completions", json=greedy_chat_body("wedge me", 40), timeout=60
    ).json()["choices"][0]["token_ids"]
    worker_pid = srv.status()["worker_pid"]

    def request() -> dict:
        return httpx.post(
            srv.v1 + "/chat/completions", json=greedy_chat_body("wedge me", 40), timeout=120
        ).json()

    with ThreadPoolExecutor(1) as pool:
        r = httpx.post(srv.url + f"/models/{srv.model}/fault", json={"kind": "wedge"}, timeout=10)
        assert r.status_code == 202, r.text
        fut = pool.submit(request)
        body = fut.result(timeout=120)
    assert body["choices"][0]["token_ids"] == expected
    assert srv.status()["worker_pid"] != worker_pid
    assert "wedged" in srv.log()


def test_a_stalled_gateway_does_not_kill_its_healthy_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The gateway stopped for twice the heartbeat timeout (descheduled, swapping):
    on waking, the worker's beats sit unread in the socket. Its silence was the
    gateway's, so the worker keeps serving; a worker frozen after that is still
    found and restarted."""
    env = {**FAST_RESTART, "MLXD_WORKER_HEARTBEAT_S": "0.25", "MLXD_HEARTBEAT_TIMEOUT_S": "1"}
    srv = start_server(str(tiny_model_dir), tmp_path / "server.log", model_name="tiny", env=env)
    try:
        worker_pid = srv.status()["worker_pid"]
        os.kill(srv.proc.pid, signal.SIGSTOP)
        time.sleep(2.5)  # the fault's length, not a wait for an event
        os.kill(srv.proc.pid, signal.SIGCONT)
        r = httpx.post(srv.v1 + "/chat/completions", json=greedy_chat_body("hi", 4), timeout=60)
        assert r.status_code == 200, r.text
        status = srv.status()
        assert (status["worker_pid"], status["restarts"]) == (worker_pid, 0), srv.log()[-2000:]

        os.kill(worker_pid, signal.SIGSTOP)  # frozen: no beats at all
        _wait_until(lambda: srv.status()["worker_pid"] not in (None, worker_pid), 30, "restart")
        assert "no heartbeat from the worker" in srv.log()
    finally:
        stop_server(srv)


def test_model_that_fails_to_load_ends_in_failed_without_restart_loop(tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    log = tmp_path / "server.log"
    import subprocess
    import sys

    from tests.helpers import free_port  # a server that never becomes ready

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--model",
            str(broken),
            "--model-name",
            "broken",
            "--port",
            str(port),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **FAST_RESTART),
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def failed() -> bool:
            try:
                r = httpx.get(url + "/startup", timeout=2)
            except httpx.TransportError:
                return False
            return r.status_code == 503 and r.json().get("phase") == "failed"

        _wait_until(failed, 120, "the FAILED state")
        startup = httpx.get(url + "/startup").json()
        assert "load" in startup["reason"]
        status = httpx.get(url + "/models/broken/status").json()
        assert status["state"] == "failed" and status["restarts"] == 0
        assert "load" in status["reason"]
        assert httpx.get(url + "/ready").status_code == 503
        assert httpx.get(url + "/live").status_code == 200
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "broken", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and "error" in r.json()
        assert log.read_text().count("worker started") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_load_that_ran_out_of_memory_is_retried_and_the_model_serves(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Out of memory while loading (other processes on the GPU held it, as in
    session 13's benchmark) is not a model that cannot load: the worker says
    so with its own exit code, the supervisor restarts it as after a crash,
    and the next start serves."""
    marker = tmp_path / "fail-next-load"
    marker.write_text("")
    env = {**FAST_RESTART, LOAD_NO_MEMORY_ENV: str(marker)}
    log = tmp_path / "server.log"
    srv = start_server(str(tiny_model_dir), log, model_name="tiny", env=env)
    try:
        assert not marker.exists()  # the first load failed on it
        status = srv.status()
        assert status["state"] == "ready" and status["restarts"] == 1
        text = log.read_text()
        assert "out of memory" in text and text.count("worker started: pid") == 2
        r = httpx.post(srv.v1 + "/chat/completions", json=greedy_chat_body("hi", 3), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        stop_server(srv)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory"), "NO_MEMORY"),
        (RuntimeError("[malloc] Unable to allocate 1048576 bytes."), "NO_MEMORY"),
        (MemoryError(), "NO_MEMORY"),
        (
            RuntimeError(
                "[metal::malloc] Attempting to allocate 9 bytes which is greater than "
                "the maximum allowed buffer size of 8 bytes."
            ),
            "MODEL_LOAD",
        ),
        (ValueError("Model type no-such-architecture not supported."), "MODEL_LOAD"),
        (FileNotFoundError("m is not a model directory (no config.json)"), "MODEL_LOAD"),
    ],
)
def test_only_a_want_of_memory_makes_a_load_failure_restartable(
    error: BaseException, code: str
) -> None:
    assert exit_codes.load_failure_code(error) == getattr(exit_codes, code)
    restartable = exit_codes.load_failure_code(error) not in exit_codes.NOT_RESTARTABLE
    assert restartable == (code == "NO_MEMORY")


def test_sigkill_gateway_leaves_no_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_server(str(tiny_model_dir), tmp_path / "server.log", model_name="tiny")
    worker_pid = srv.status()["worker_pid"]
    assert _pid_alive(worker_pid)
    srv.proc.kill()
    srv.proc.wait()
    _wait_until(lambda: not _pid_alive(worker_pid), 10, f"worker {worker_pid} to exit")


def test_sigterm_lets_in_flight_requests_finish(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_server(
        str(tiny_model_dir),
        tmp_path / "server.log",
        model_name="tiny",
        env={"MLXD_SHUTDOWN_GRACE_S": "30"},
    )
    worker_pid = srv.status()["worker_pid"]
    started = threading.Barrier(5)

    def streaming(i: int) -> list[str]:
        events = []
        with httpx.stream(
            "POST",
            srv.v1 + "/chat/completions",
            json=greedy_chat_body(f"drain {i}", 150, stream=True),
            timeout=120,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        started.wait(60)
                    events.append(line[6:])
        return events

    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(streaming, i) for i in range(4)]
        started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=120) for f in futs]
    for events in results:
        assert events[-1] == "[DONE]"
        finals = [json.loads(e) for e in events[:-1]]
        assert not any("error" in f for f in finals)
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(f["choices"][0].get("token_ids") or []) for f in finals) == 150
    assert srv.proc.wait(60) == 0
    _wait_until(lambda: not _pid_alive(worker_pid), 10, "the worker to exit")
