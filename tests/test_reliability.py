"""Slow readers, disconnect storms and a broken worker connection, on one real server.

- A client that reads one byte a second is cut off by the stated policy
  (gateway/http/slow_reader.py, docs/api.md#slow-readers): its request ends with
  finish reason `slow_reader`, is aborted in the worker, and its connection is
  reset, for streaming and non-streaming responses alike.
- 200 clients connect, start requests and vanish at random points (mid-body,
  tokenization, queue, prefill, decode; some with a reset). Afterwards nothing
  is left: no request, batch row or reservation in the worker, no queue entry,
  stream, asyncio task or file descriptor in the gateway, and the worker's
  memory is back to its resting level (what the prefix cache keeps aside).
- The worker's connection breaks under load (the worker sends a frame the
  gateway cannot decode): the supervisor kills and restarts the worker; no
  crash, no hang, requests that had sent nothing are replayed.

The tests share one server and run in file order: the last one restarts the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import NO_EOS, Server, start_server, stop_server, wait_for

SLOW_READER_S = 2.0
ENV = {
    "MLXD_SLOW_READER_TIMEOUT_S": str(SLOW_READER_S),
    "MLXD_MAX_IN_FLIGHT": "8",  # most of a storm waits in the queue
    "MLXD_MAX_QUEUED": "512",
    "MLXD_PREFILL_CHUNK": "64",  # long prompts take several prefill steps
    "MLXD_SSE_KEEPALIVE_S": "0",
    "MLXD_TEST_FAULTS": "true",
    "MLXD_RESTART_BACKOFF_INITIAL_S": "0.1",
    "MLXD_REQUEST_TIMEOUT_S": "120",
}


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("reliability") / "server.log",
        model_name="tiny",
        env=ENV,
    )
    yield s
    stop_server(s)


# -- what the gateway and the worker hold -------------------------------------------


def gateway_fds(srv: Server) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def metric(srv: Server, name: str, **labels: str) -> float | None:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(part in (m[1] or "") for part in want.split(",") if part):
            return float(m[2])
    return None


def live_state(srv: Server) -> dict[str, Any]:
    """Everything that must be zero when no request is in flight."""
    st = srv.status()
    w = st["worker"]
    gov = w["governor"]
    return {
        "worker.requests": w["requests"],
        "worker.batch_rows": w["batch_rows"],
        "worker.queued": w["queued"],
        "governor.reserved_requests": gov["reserved_requests"],
        "governor.reserved_growth": gov["reserved_growth"],
        "governor.live_state": gov["live_state"],
        "gateway.in_flight": st["queue"]["in_flight"],
        "gateway.queued": st["queue"]["queued"],
        "gateway.streams": st["in_flight"],
    }


def resting_memory(srv: Server) -> int:
    """MLX's active memory minus what the prefix cache keeps on purpose."""
    w = srv.worker_stats()
    return int(w["memory"]["active_bytes"]) - int(w["prefix_cache"]["allocated_bytes"])


def worker_rss(srv: Server) -> int:
    pid = srv.status()["worker_pid"]
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def settle(srv: Server, fds: int, tasks: float | None, timeout_s: float = 30) -> None:
    """Wait until no request is live and the gateway is back to its resting fds/tasks."""
    wait_for(lambda: not any(live_state(srv).values()), timeout_s, "no live request state")
    wait_for(lambda: gateway_fds(srv) <= fds, timeout_s, f"gateway fds back to {fds}")
    if tasks is not None:
        wait_for(
            lambda: (metric(srv, "mlxd_gateway_asyncio_tasks") or 0) <= tasks,
            timeout_s,
            f"gateway tasks back to {tasks}",
        )


def baseline(srv: Server) -> tuple[int, float | None]:
    # A finished request first, so lazily created state (pools, caches) exists.
    r = httpx.post(
        srv.v1 + "/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "warm"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200
    settle(srv, fds=10**6, tasks=None)
    time.sleep(0.2)
    return gateway_fds(srv), metric(srv, "mlxd_gateway_asyncio_tasks")


# -- slow readers -----------------------------------------------------------------------


def _cut_off_logged(srv: Server, request_id: str) -> bool:
    return any(
        f'"client_request_id": "{request_id}"' in line and '"finish_reason": "slow_reader"' in line
        for line in srv.log().splitlines()
    )


def _slow_client(srv: Server, body: dict[str, Any], request_id: str, drip: bool) -> dict:
    """A raw HTTP client with a tiny receive buffer that stops keeping up.

    drip: it reads one byte a second throughout, and finally as fast as it can
    once the server's grace after the cut-off has passed. Otherwise it reads
    nothing until the server has logged the cut-off, then catches up at once.
    Returns how the connection ended and the bytes read at the end.
    """
    s = _send_with_small_buffer(srv, body, request_id)
    deadline = time.monotonic() + 90
    while not _cut_off_logged(srv, request_id):
        assert time.monotonic() < deadline, f"{request_id} was never cut off"
        if drip:
            assert s.recv(1), "the server closed before cutting off"
        time.sleep(1.0)
    if drip:  # still one byte a second, past the grace the server gives
        for _ in range(int(SLOW_READER_S) + 2):
            s.recv(1)
            time.sleep(1.0)
    s.settimeout(10)
    data, end = b"", "eof"
    try:
        while chunk := s.recv(1 << 20):
            data += chunk
    except ConnectionResetError:
        end = "reset"
    except TimeoutError:
        end = "open"
    s.close()
    return {"end": end, "data": data}


def _send_with_small_buffer(srv: Server, body: dict[str, Any], request_id: str) -> socket.socket:
    """A raw connection with a 4 KiB receive buffer, the chat request sent on it."""
    payload = json.dumps(body).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"X-Request-ID: %s\r\nContent-Length: %d\r\n\r\n"
        % (request_id.encode(), len(payload))
        + payload
    )
    return s


def _steady_client(srv: Server, body: dict[str, Any], request_id: str) -> dict:
    """A client that reads a large response slowly but steadily.

    Its small receive buffer caps each read at a few KB: it takes the body at
    a few hundred KB/s, so the server's writes wait on it again and again.
    """
    s = _send_with_small_buffer(srv, body, request_id)
    s.settimeout(90)
    data = b""
    started = None
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        started = started or time.monotonic()
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        m = re.search(rb"Content-Length: (\d+)", head, re.I)
        if sep and m and len(rest) >= int(m[1]):
            break
        # Paced so the whole body takes well over 2 x slow_reader_timeout_s however
        # fast the engine is, while no single write waits anywhere near that long.
        time.sleep(0.006)
    s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return {
        "head": head,
        "body": rest,
        "read_s": time.monotonic() - (started or time.monotonic()),
    }


def test_slow_readers_are_cut_off(srv: Server) -> None:
    fds, tasks = baseline(srv)
    before = srv.worker_stats()
    big = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "talk"}],
        # Top-20 logprobs make every token about 1.7 KB of JSON: 3000 tokens are
        # more than the kernel's socket buffers (up to 4 MB here) can take.
        "max_tokens": 3000,
        "logprobs": True,
        "top_logprobs": 20,
        "logit_bias": NO_EOS,
    }
    with ThreadPoolExecutor(4) as pool:
        dripping = pool.submit(_slow_client, srv, {**big, "stream": True}, "slow-drip", True)
        catching_up = pool.submit(_slow_client, srv, {**big, "stream": True}, "slow-stall", False)
        whole = pool.submit(_slow_client, srv, big, "slow-whole", True)
        steadily = pool.submit(_steady_client, srv, big, "slow-steady")
        drip, stall, plain, steady = (
            f.result(timeout=150) for f in (dripping, catching_up, whole, steadily)
        )
    # Slow but steady is not cut off, however long the whole body takes: the
    # timeout bounds one write that makes no progress.
    assert steady["head"].startswith(b"HTTP/1.1 200"), steady["head"]
    assert steady["read_s"] > 2 * SLOW_READER_S, steady["read_s"]
    print(f"steady reader: {len(steady['body']) >> 10} KiB in {steady['read_s']:.1f}s")
    assert json.loads(steady["body"])["usage"]["completion_tokens"] == 3000
    # A reader that never catches up is reset once the grace has passed: the
    # socket and the kernel's unsent buffers are gone, not kept for it.
    assert drip["end"] == "reset", drip["end"]
    assert plain["end"] == "reset", plain["end"]
    # A reader that catches up within the grace finds the terminal event.
    events = [line for line in stall["data"].split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", events[-3:]
    assert json.loads(events[-2][6:])["error"]["code"] == "slow_reader"
    records = {
        rec["client_request_id"]: rec
        for rec in (
            json.loads(line) for line in srv.log().splitlines() if '"client_request_id"' in line
        )
    }
    for rid in ("slow-drip", "slow-stall", "slow-whole"):
        rec = records[rid]
        assert rec["finish_reason"] == "slow_reader", rec
        assert rec["status"] == 200 and not rec["cancelled"], rec
        assert rec["error"].startswith("slow_reader"), rec
    # The streams were still generating when they were cut: aborted in the
    # worker at once, short of their max_tokens (the whole response had finished).
    assert records["slow-drip"]["completion_tokens"] < 3000
    assert records["slow-whole"]["completion_tokens"] == 3000
    settle(srv, fds, tasks)
    after = srv.worker_stats()
    assert after["requests_aborted"] == before["requests_aborted"] + 2
    assert metric(srv, "mlxd_requests_total", finish_reason="slow_reader") == 3


# -- disconnect storm ------------------------------------------------------------------

STORM_CLIENTS = 200
MODES = ("mid_body", "after_send", "queued", "first_token", "decode", "reset", "complete")


async def _storm_client(host: str, port: int, rng: random.Random) -> tuple[str, str]:
    """One client that starts a request and vanishes at a random point; (mode, outcome)."""
    mode = rng.choice(MODES)
    long_prompt = rng.random() < 0.3
    content = "word " * (rng.randint(300, 600) if long_prompt else rng.randint(1, 20))
    stream = mode != "complete" or rng.random() < 0.5
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": rng.randint(8, 32),
            "stream": stream,
            "logit_bias": NO_EOS,
        }
    ).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    await asyncio.sleep(rng.uniform(0, 1.0))  # arrivals spread over a second
    reader, writer = await asyncio.open_connection(host, port)
    outcome = "vanished"
    try:
        if mode == "mid_body":
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.2))
            return mode, outcome
        writer.write(head + body)
        await writer.drain()
        if mode == "after_send":
            return mode, outcome  # gone during tokenization or admission
        if mode == "queued":
            await asyncio.sleep(rng.uniform(0, 0.5))
            return mode, outcome
        wanted = {"first_token": 1, "decode": rng.randint(2, 6), "reset": rng.randint(1, 6)}
        seen, data = 0, b""
        async with asyncio.timeout(90):
            while chunk := await reader.read(1 << 16):
                data += chunk
                seen = data.count(b"data: {")
                if mode in wanted and seen >= wanted[mode]:
                    return mode, outcome
        if mode == "complete":
            ok = data.startswith(b"HTTP/1.1 200") and (
                (b"data: [DONE]" in data and b'"error"' not in data) if stream else True
            )
            outcome = "complete" if ok else "broken: " + data[-300:].decode(errors="replace")
        else:
            outcome = "finished before leaving"  # shorter than the events it waited for
        return mode, outcome
    finally:
        if mode == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()


async def _storm(srv: Server, seed: int) -> list[tuple[str, str]]:
    host, port = srv.url.removeprefix("http://").split(":")
    rng = random.Random(seed)
    clients = [
        _storm_client(host, int(port), random.Random(rng.random())) for _ in range(STORM_CLIENTS)
    ]
    return list(await asyncio.gather(*clients))


def test_disconnect_storm_leaves_nothing_behind(srv: Server) -> None:
    fds, tasks = baseline(srv)
    memory, rss = resting_memory(srv), worker_rss(srv)
    before = srv.worker_stats()
    started = time.monotonic()
    results = asyncio.run(_storm(srv, seed=7))
    storm_s = time.monotonic() - started
    modes = {m: sum(1 for r in results if r[0] == m) for m in MODES}
    assert all(modes.values()), modes  # every way of leaving happened
    broken = [r for r in results if r[1].startswith("broken")]
    assert not broken, broken[:3]
    settle(srv, fds, tasks)
    after = srv.worker_stats()
    # Every request the worker saw was retired exactly once, aborted or finished.
    added = after["requests_added"] - before["requests_added"]
    retired = (
        after["requests_finished"]
        - before["requests_finished"]
        + after["requests_aborted"]
        - before["requests_aborted"]
        + after["requests_rejected"]
        - before["requests_rejected"]
    )
    assert added == retired, (added, retired)
    assert after["requests_aborted"] > before["requests_aborted"]
    # Memory: the batch's KV state is gone; only the prefix cache (bounded by
    # its budget) keeps what aborted sequences computed.
    assert after["governor"]["live_state"] == 0
    grown = resting_memory(srv) - memory
    assert grown <= 1 << 20, f"MLX memory outside the prefix cache grew by {grown} bytes"
    cache = after["prefix_cache"]
    assert cache["bytes"] <= cache["max_bytes"], cache
    rss_growth = worker_rss(srv) - rss
    print(
        f"storm: {STORM_CLIENTS} clients in {storm_s:.1f}s, modes {modes}, worker requests "
        f"+{added}, gateway fds {fds} -> {gateway_fds(srv)}, worker RSS +{rss_growth >> 20} MiB"
    )
    # The server serves normally afterwards.
    r = httpx.post(
        srv.v1 + "/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "after"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# -- a broken worker connection ----------------------------------------------------------


PLAIN_TOKENS = 200


def test_broken_worker_connection_restarts_the_worker(srv: Server) -> None:
    status = srv.status()
    old_pid, restarts = status["worker_pid"], status["restarts"]
    live_failures: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=2) as c:
            while not stop.wait(0.05):
                try:
                    if c.get(srv.url + "/live").status_code != 200:
                        live_failures.append("status")
                except httpx.HTTPError as e:
                    live_failures.append(repr(e))

    def chat(i: int, stream: bool, max_tokens: int) -> httpx.Response:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"broken connection {i}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "stream": stream,
        }
        return httpx.post(srv.v1 + "/chat/completions", json=body, timeout=120)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    with ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(chat, i, True, 400) for i in range(4)]
        # long enough that all are still running when the fault hits, however
        # the twelve arrivals interleave on a loaded machine
        plain = [pool.submit(chat, i, False, PLAIN_TOKENS) for i in range(4, 12)]
        wait_for(lambda: srv.worker_stats()["requests"] >= 8, 30, "requests in the worker")
        r = httpx.post(srv.url + "/models/tiny/fault", json={"kind": "corrupt"}, timeout=10)
        assert r.status_code == 202, r.text
        plain_results = [f.result(timeout=120) for f in plain]
        stream_results = [f.result(timeout=120) for f in streams]
    stop.set()
    prober.join()
    assert srv.proc.poll() is None, "the gateway died"
    assert not live_failures, live_failures[:3]
    for resp in plain_results:  # nothing sent yet: replayed on the new worker
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == PLAIN_TOKENS
    for resp in stream_results:  # every stream ended, cleanly or with an error event
        events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", resp.text[-500:]
    wait_for(lambda: srv.status()["ready"], 30, "the new worker")
    status = srv.status()
    assert status["worker_pid"] != old_pid and status["restarts"] == restarts + 1
    wait_for(lambda: not _alive(old_pid), 10, "the old worker to be gone")
    assert "protocol error" in srv.log()
    assert not any(live_state(srv).values()), live_state(srv)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_bounded_write_abandoned_then_failing_is_not_an_unretrieved_error() -> None:
    """gateway/http/slow_reader.py `_bounded`: when the handler is cancelled (the
    client left), the write it stops waiting for may still fail (a reset
    connection). That failure is retrieved, not logged by asyncio as "Task
    exception was never retrieved" (one such error line per departed client in
    session 16's H200 run)."""
    import gc

    from gateway.http import slow_reader

    class _Closing:
        def is_closing(self) -> bool:
            return True

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        started = asyncio.Event()

        async def write() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise ConnectionResetError("Cannot write to closing transport") from None

        outer = asyncio.ensure_future(
            slow_reader._bounded(None, write, 60.0, _Closing())  # type: ignore[arg-type]
        )
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        for _ in range(3):
            await asyncio.sleep(0)  # the write's task ends with its error
        del outer
        gc.collect()
        return reported

    reported = asyncio.run(main())
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported
