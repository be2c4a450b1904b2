"""Soak: a mixed workload for a fixed number of requests, with random cancellations.

Not part of `make test` (the `soak` marker is deselected by default); run it
with `make soak` (MLXD_SOAK_REQUESTS=N, default 5000; MLXD_SOAK_CONCURRENCY,
default 16). What must hold at the end:

- no lost request: every request the clients sent has exactly one outcome
  (answered, refused, or cancelled by its client), the gateway logged exactly
  one line for each, and the worker retired every request it was given;
- steady resources: the gateway's file descriptors and asyncio tasks return to
  their resting values, and neither process's RSS keeps growing through the
  second half of the run;
- the prefix cache never holds more bytes than its budget (a small one here,
  so that it fills and evicts).

It prints its figures (requests, outcomes, RSS and fds before/after) as a
`SOAK` line; docs/reliability.md records a run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Server, start_server, stop_server

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]

REQUESTS = int(os.environ.get("MLXD_SOAK_REQUESTS", "5000"))
CONCURRENCY = int(os.environ.get("MLXD_SOAK_CONCURRENCY", "16"))
PREFIX_CACHE_BYTES = 4 << 20
NO_EOS = {"0": -100, "1": -100, "2": -100}
PREFIXES = [f"You are assistant number {i}. " + "Be brief and exact. " * 20 for i in range(6)]


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("soak") / "server.log",
        model_name="tiny",
        env={
            "MLXD_PREFIX_CACHE_BYTES": str(PREFIX_CACHE_BYTES),
            "MLXD_MAX_IN_FLIGHT": "16",
            "MLXD_MAX_QUEUED": "1024",
            "MLXD_PREFILL_CHUNK": "128",
            "MLXD_MAX_TOKENS_LIMIT": "64",
            "MLXD_SLOW_READER_TIMEOUT_S": "10",
        },
    )
    yield srv
    stop_server(srv)


@dataclass
class Sample:
    done: int
    gateway_rss: int
    gateway_fds: int
    gateway_tasks: float
    worker_rss: int
    mlx_active: int
    mlx_cache: int
    prefix_bytes: int
    prefix_max: int


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    by_id: dict[str, str] = field(default_factory=dict)  # request id -> outcome
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m[1]) if m else -1.0


async def _sample(srv: Server, client: httpx.AsyncClient, done: int) -> Sample:
    status = (await client.get(f"/models/{srv.model}/status")).json()
    cache = status["worker"]["prefix_cache"]
    mlx = status["worker"]["memory"]
    return Sample(
        done=done,
        gateway_rss=_rss(srv.proc.pid),
        gateway_fds=_fds(srv.proc.pid),
        gateway_tasks=await _metric(client, "mlxd_gateway_asyncio_tasks"),
        worker_rss=_rss(status["worker_pid"]),
        mlx_active=int(mlx["active_bytes"]),
        mlx_cache=int(mlx["cache_bytes"]),
        prefix_bytes=int(cache["bytes"]),
        prefix_max=int(cache["max_bytes"]),
    )


def _request(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    """A random request: (path, body, stream)."""
    stream = rng.random() < 0.5
    kind = rng.random()
    common: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": rng.randint(1, 48),
        "stream": stream,
        "logit_bias": NO_EOS,
        "temperature": rng.choice([0, 0.7, 1.0]),
    }
    if rng.random() < 0.2:
        common["seed"] = rng.randint(0, 1000)
    if kind < 0.05:  # refused: over the server's max_tokens limit
        common["max_tokens"] = 65
    if kind < 0.55:
        user = rng.choice(["hello", "tell me a story", "a b c " * rng.randint(1, 60)])
        body = {
            **common,
            "messages": [
                {"role": "system", "content": rng.choice(PREFIXES)},  # shared prefixes
                {"role": "user", "content": user},
            ],
        }
        if rng.random() < 0.15:
            body["stop"] = ["e", "th"]
        if rng.random() < 0.1:
            body["logprobs"], body["top_logprobs"] = True, 3
        if stream and rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", body, stream
    prompt: Any = rng.choice(PREFIXES) + "continue " * rng.randint(0, 30)
    if rng.random() < 0.2:
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 400))]
    return "/v1/completions", {**common, "prompt": prompt}, stream


async def _one(client: httpx.AsyncClient, rng: random.Random, tally: Tally, rid: str) -> None:
    """Send one request; record exactly one outcome for it."""
    path, body, stream = _request(rng)
    headers = {"X-Request-ID": rid}
    cancel_after = rng.uniform(0.0, 0.3) if rng.random() < 0.15 else None
    outcome = "lost"

    async def call() -> str:
        if not stream:
            r = await client.post(path, json=body, headers=headers)
            if r.status_code != 200:
                assert "error" in r.json(), r.text
                return f"http {r.status_code}"
            return "ok"
        async with client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                assert "error" in r.json(), r.text
                return f"http {r.status_code}"
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = line
                    if '"error"' in line:
                        return "stream error"
            return "ok" if last == "data: [DONE]" else "truncated"

    try:
        if cancel_after is None:
            async with asyncio.timeout(120):
                outcome = await call()
        else:
            try:
                async with asyncio.timeout(cancel_after):
                    outcome = await call()
            except TimeoutError:
                outcome = "cancelled"
    except TimeoutError:
        outcome = "lost"  # a request that never ended
    except (httpx.HTTPError, AssertionError, ValueError) as e:
        outcome = "failed"
        tally.failures.append(f"{path} {body}: {e!r}"[:400])
    tally.outcomes[outcome] += 1
    assert rid not in tally.by_id
    tally.by_id[rid] = outcome


async def _run(srv: Server, tally: Tally) -> None:
    rng = random.Random(1234)
    done = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=CONCURRENCY + 4, max_keepalive_connections=CONCURRENCY)
    async with (
        httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client,
        httpx.AsyncClient(base_url=srv.url, timeout=30) as monitor,
    ):
        tally.samples.append(await _sample(srv, monitor, 0))
        every = max(1, REQUESTS // 10)

        async def worker(seed: int) -> None:
            nonlocal done
            wrng = random.Random(seed)
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await _one(client, wrng, tally, f"soak-{i}")
                done += 1
                if done % every == 0:
                    tally.samples.append(await _sample(srv, monitor, done))

        await asyncio.gather(*(worker(rng.randrange(1 << 30)) for _ in range(CONCURRENCY)))


def _settled(srv: Server) -> dict[str, Any]:
    st = srv.status()
    w = st["worker"]
    return {
        "requests": w["requests"],
        "batch_rows": w["batch_rows"],
        "reserved": w["governor"]["reserved_requests"],
        "in_flight": st["queue"]["in_flight"],
        "queued": st["queue"]["queued"],
        "streams": st["in_flight"],
    }


def _logged_ids(srv: Server) -> Counter[str]:
    """How many request-log lines each soak request id has."""
    return Counter(
        json.loads(line)["client_request_id"]
        for line in srv.log().splitlines()
        if line.startswith("{") and '"event": "request"' in line and '"soak-' in line
    )


def test_soak(soak_server: Server) -> None:
    srv = soak_server
    before = srv.worker_stats()
    tally = Tally()
    started = time.monotonic()
    asyncio.run(_run(srv, tally))
    elapsed = time.monotonic() - started

    # Settle: nothing live, resting fds and tasks (cancelled connections close).
    deadline = time.monotonic() + 60
    while any(_settled(srv).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_settled(srv).values()), _settled(srv)
    first = tally.samples[0]
    while time.monotonic() < deadline and _fds(srv.proc.pid) > first.gateway_fds:
        time.sleep(0.2)
    time.sleep(0.5)
    final = asyncio.run(_final_sample(srv))
    after = srv.worker_stats()
    logged = _logged_ids(srv)
    # A request cancelled before its bytes reached the server has no line.
    unlogged = [rid for rid in tally.by_id if rid not in logged]

    o = tally.outcomes
    figures = {
        "requests": REQUESTS,
        "concurrency": CONCURRENCY,
        "seconds": round(elapsed, 1),
        "outcomes": dict(o),
        "logged": sum(logged.values()),
        "cancelled_before_arrival": len(unlogged),
        "worker_added": after["requests_added"] - before["requests_added"],
        "worker_finished": after["requests_finished"] - before["requests_finished"],
        "worker_aborted": after["requests_aborted"] - before["requests_aborted"],
        "worker_rejected": after["requests_rejected"] - before["requests_rejected"],
        "gateway_fds": [first.gateway_fds, final.gateway_fds],
        "gateway_tasks": [first.gateway_tasks, final.gateway_tasks],
        "gateway_rss_mib": [first.gateway_rss >> 20, final.gateway_rss >> 20],
        "worker_rss_mib": [first.worker_rss >> 20, final.worker_rss >> 20],
        "worker_mlx_active_mib": [first.mlx_active >> 20, final.mlx_active >> 20],
        "worker_mlx_cache_mib": [first.mlx_cache >> 20, final.mlx_cache >> 20],
        "prefix_cache_bytes_max_seen": max(s.prefix_bytes for s in tally.samples),
        "prefix_cache_budget": final.prefix_max,
        "prefix_cache_evictions": after["prefix_cache"].get("evictions"),
        # done, gateway RSS MiB, gateway fds, worker RSS MiB, MLX active/cache MiB, prefix bytes
        "samples": [
            (
                s.done,
                s.gateway_rss >> 20,
                s.gateway_fds,
                s.worker_rss >> 20,
                s.mlx_active >> 20,
                s.mlx_cache >> 20,
                s.prefix_bytes,
            )
            for s in tally.samples
        ],
    }
    print("SOAK " + json.dumps(figures))

    # No lost request: one outcome each, one log line each, all retired in the worker.
    assert sum(o.values()) == REQUESTS, o
    assert o["lost"] == 0 and o["failed"] == 0 and o["truncated"] == 0, (o, tally.failures[:5])
    assert o["stream error"] == 0, o
    assert set(o) <= {"ok", "cancelled", "http 400"}, o
    # The server gave every request it saw exactly one terminal outcome (one log
    # line); only client-cancelled ones may not have reached it at all.
    assert all(n == 1 for n in logged.values()), [k for k, n in logged.items() if n > 1][:5]
    assert set(logged) <= set(tally.by_id)
    assert all(tally.by_id[rid] == "cancelled" for rid in unlogged), unlogged[:5]
    added = figures["worker_added"]
    retired = figures["worker_finished"] + figures["worker_aborted"] + figures["worker_rejected"]
    assert added == retired, figures

    # Steady resources.
    assert final.gateway_fds <= first.gateway_fds, figures
    assert final.gateway_tasks <= first.gateway_tasks, figures
    half = [s for s in tally.samples if s.done >= REQUESTS // 2]
    if len(half) >= 2:
        for what in ("gateway_rss", "worker_rss"):
            grew = getattr(half[-1], what) - getattr(half[0], what)
            assert grew < 64 << 20, f"{what} grew by {grew >> 20} MiB in the second half"
    for s in tally.samples:
        assert s.prefix_bytes <= s.prefix_max, s


async def _final_sample(srv: Server) -> Sample:
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as monitor:
        return await _sample(srv, monitor, REQUESTS)
