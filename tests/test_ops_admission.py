"""Admission: queue and in-flight caps, 503 + Retry-After, the gate's bookkeeping, traces.

Unit tests drive `Admission` and `RateLimiter` directly; the HTTP tests run a real
server with one in-flight slot and one queue place, so the third concurrent
request must get a 503 before it is tokenized.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.http.errors import APIError
from gateway.serving.admission import Admission, RateLimiter
from tests.helpers import Server, assert_serving, start_server, stop_server, wait_for

# -- the gate, in-process -------------------------------------------------------------


async def test_fifo_slots_and_release() -> None:
    adm = Admission(1, 2)
    a, b, c = adm.enter(), adm.enter(), adm.enter()
    assert (adm.queued, adm.in_flight, adm.open) == (3, 0, False)
    with pytest.raises(APIError) as e:
        adm.enter()
    assert e.value.status == 503 and "Retry-After" in e.value.headers
    await a.acquire()
    order: list[str] = []

    async def wait(t, name: str) -> None:
        await t.acquire()
        order.append(name)

    tasks = [asyncio.create_task(wait(b, "b")), asyncio.create_task(wait(c, "c"))]
    await asyncio.sleep(0)
    assert order == [] and adm.in_flight == 1 and adm.queued == 2
    a.release()
    a.release()  # idempotent
    await asyncio.sleep(0)
    assert order == ["b"] and adm.in_flight == 1 and adm.queued == 1
    b.release()
    await asyncio.gather(*tasks)
    assert order == ["b", "c"]
    c.release()
    assert (adm.queued, adm.in_flight) == (0, 0)


async def test_cancelled_waiter_frees_its_place() -> None:
    adm = Admission(1, 5)
    a, b, c = adm.enter(), adm.enter(), adm.enter()
    await a.acquire()
    tb = asyncio.create_task(b.acquire())
    tc = asyncio.create_task(c.acquire())
    await asyncio.sleep(0)
    tb.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tb
    b.release()
    assert adm.queued == 1
    a.release()
    await tc  # the slot skips the cancelled waiter
    assert adm.in_flight == 1
    c.release()
    # No stale waiter is left behind: a newcomer gets the free slot at once.
    d = adm.enter()
    await asyncio.wait_for(d.acquire(), 1)
    d.release()
    assert (adm.queued, adm.in_flight) == (0, 0)


def test_retry_after_follows_the_drain_rate() -> None:
    adm = Admission(1, 10, window_s=10, retry_after_min_s=1, retry_after_max_s=60)
    assert adm.retry_after() == 60  # nothing drained yet: the upper bound
    now = time.monotonic()
    adm.drain._since = now - 100  # as if the server had been up longer than the window
    for i in range(20):  # 2 per second over a full window
        adm.drain.record(now - 10 + i * 0.5)
    assert 1.5 <= adm.drain.rate(now) <= 2.1
    adm.queued = 9
    assert adm.retry_after(now) == 5  # (9 + 1) / 2 per second
    adm.queued = 0
    assert adm.retry_after(now) == 1
    adm.retry_after_max_s = 3
    adm.queued = 9
    assert adm.retry_after(now) == 3


def test_rate_limiter_token_bucket() -> None:
    rl = RateLimiter()
    t = 1000.0
    assert rl.check("k", 60, 2, t) == 0 and rl.check("k", 60, 2, t) == 0
    wait = rl.check("k", 60, 2, t)
    assert 0.9 < wait <= 1.0
    assert rl.check("other", 60, 2, t) == 0  # buckets are per key
    assert rl.check("k", 60, 2, t + 1.0) == 0  # refilled one token
    assert rl.check("k", 0, 0, t) == 0  # 0 rpm: unlimited


# -- through HTTP ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("gated")
    srv = start_server(
        str(tiny_model_dir),
        d / "server.log",
        model_name="tiny",
        env={"MLXD_MAX_IN_FLIGHT": "1", "MLXD_MAX_QUEUED": "1", "MLXD_DRAIN_WINDOW_S": "60"},
        extra_args=["--trace-file", str(d / "trace.json")],
    )
    srv.trace_path = d / "trace.json"  # type: ignore[attr-defined]
    yield srv
    stop_server(srv)


def _chat(srv: Server, max_tokens: int, rid: str | None = None, **kw: object) -> httpx.Response:
    headers = {"X-Request-ID": rid} if rid else {}
    return httpx.post(
        f"{srv.v1}/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **kw,
        },
        headers=headers,
        timeout=120,
    )


def test_queue_full_is_503_with_retry_after(gated: Server) -> None:
    for i in range(3):  # a measured drain rate
        assert _chat(gated, 2, f"warm-{i}").status_code == 200
    added_before = gated.worker_stats()["requests_added"]
    results: dict[str, httpx.Response] = {}
    with httpx.stream(
        "POST",
        f"{gated.v1}/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 3000,
            "temperature": 0,
            "stream": True,
        },
        headers={"X-Request-ID": "holder"},
        timeout=120,
    ) as holder:
        lines = holder.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # in flight now
        waiter = threading.Thread(
            target=lambda: results.__setitem__("queued", _chat(gated, 4, "queued"))
        )
        waiter.start()
        wait_for(lambda: gated.status()["queue"]["queued"] == 1, what="a queued request")
        assert gated.worker_stats()["requests_added"] == added_before + 1  # only the holder

        # Refused at once: answered while the holder still holds the only slot.
        r = _chat(gated, 2, "refused")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "service_unavailable_error"
        assert set(err) == {"message", "type", "param", "code"}
        retry = int(r.headers["Retry-After"])
        assert 1 <= retry <= 60
        assert r.headers["X-Request-ID"] == "refused"
        # Neither tokenized nor sent to the worker.
        assert gated.worker_stats()["requests_added"] == added_before + 1

        ready = httpx.get(gated.url + "/ready")
        assert ready.status_code == 503 and "admission closed" in ready.json()["reason"]
        assert not results  # the queued request is still waiting
    # Leaving the block disconnects the holder: its slot goes to the queued request.
    waiter.join(60)
    assert results["queued"].status_code == 200, results["queued"].text
    assert results["queued"].json()["usage"]["completion_tokens"] == 4
    wait_for(lambda: httpx.get(gated.url + "/ready").status_code == 200, what="/ready")
    assert_serving(gated)

    log = [json.loads(x) for x in gated.log().splitlines() if x.startswith('{"request_id"')]
    by_id = {x["client_request_id"]: x for x in log}
    assert by_id["refused"]["status"] == 503 and by_id["refused"]["prompt_tokens"] is None
    assert by_id["holder"]["cancelled"] is True
    assert by_id["queued"]["queue_time_ms"] > by_id["warm-0"]["queue_time_ms"]

    metrics = httpx.get(gated.url + "/metrics").text
    assert 'mlxd_admission_rejections_total{model="tiny",reason="queue_full"} 1.0' in metrics


def test_trace_file_has_every_stage(gated: Server) -> None:
    assert _chat(gated, 3, "traced").status_code == 200

    expected = {
        "arrival",
        "tokenized",
        "admitted",
        "submitted",
        "first_token",
        "first_byte",
        "retired",
    }

    def mine() -> list[dict]:
        text = gated.trace_path.read_text().rstrip()  # type: ignore[attr-defined]
        try:
            events = json.loads(text.rstrip(",") + "]")  # still open: the server is running
        except ValueError:  # a record is being written
            return []
        return [e for e in events if (e.get("args") or {}).get("client_request_id") == "traced"]

    def instants() -> set[str]:
        return {e["name"] for e in mine() if e["ph"] == "i"}

    # The request's record is written when it retires, which may be just after the
    # client has read its answer; a stage that never comes fails the wait.
    wait_for(lambda: expected <= instants(), what=f"the request's trace stages {expected}")
    mine_events = mine()
    spans = {e["name"]: e for e in mine_events if e["ph"] == "X"}
    assert {"request", "tokenize", "queue", "prefill", "decode"} <= set(spans)
    req = spans["request"]
    for name in ("tokenize", "queue", "prefill", "decode"):
        s = spans[name]
        assert s["tid"] == req["tid"]
        assert req["ts"] <= s["ts"] and s["ts"] + s["dur"] <= req["ts"] + req["dur"] + 1
    assert req["args"]["completion_tokens"] == 3


def test_client_leaving_the_queue_frees_its_place(gated: Server) -> None:
    before = httpx.get(gated.url + "/metrics").text
    assert 'stage="queued"' not in before
    with httpx.stream(
        "POST",
        f"{gated.v1}/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 3000,
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    ) as holder:
        # Keep the line iterator referenced: closing it would close the response.
        lines = holder.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{gated.v1}/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "q"}],
                    "max_tokens": 2,
                },
                headers={"X-Request-ID": "gave-up"},
                timeout=httpx.Timeout(30, read=0.5),
            )
        wait_for(lambda: gated.status()["queue"]["queued"] == 0, what="the queue to empty")
        assert gated.status()["queue"]["in_flight"] == 1  # only the holder
    wait_for(lambda: gated.status()["queue"]["in_flight"] == 0, what="the holder to retire")
    assert_serving(gated)
    metrics = httpx.get(gated.url + "/metrics").text
    assert 'mlxd_cancellations_total{model="tiny",stage="queued"} 1.0' in metrics
    line = next(
        json.loads(x)
        for x in gated.log().splitlines()
        if x.startswith('{"request_id"') and '"client_request_id": "gave-up"' in x
    )
    assert line["cancelled"] is True and line["status"] == 499
