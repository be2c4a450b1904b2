"""Test helpers: real `mlxd serve` processes, request bodies, and event waits.

Fixtures live in tests/conftest.py; everything a test module imports lives here,
so no test imports conftest. `wait_for` is the one polling wait (on a condition the
server exposes, never a sleep standing in for an event), and `assert_serving` the
one check that a server still answers and retires its requests.

Servers are real: `python -m gateway.cli serve` in a subprocess, which spawns
the real worker process over a real Unix socket. Tests talk to them over HTTP
with the official openai SDK or httpx.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

# Random-weight models may pick EOS at any step; tests that count tokens ban it.
NO_EOS = {"0": -100, "1": -100, "2": -100}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def greedy_body(model: str, prompt: list[int], n: int, **extra: object) -> dict:
    """A /v1/completions body: greedy, EOS banned, token ids returned."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "return_token_ids": True,
        **extra,
    }


def greedy_chat_body(
    content: str, max_tokens: int = 8, stream: bool = False, **extra: object
) -> dict:
    """A /v1/chat/completions body for the "tiny" model: greedy, EOS banned, token ids
    returned."""
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "logit_bias": NO_EOS,
        "stream": stream,
        **extra,
    }


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    model: str
    log_path: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, headers: dict[str, str] | None = None) -> dict:
        r = httpx.get(f"{self.url}/models/{self.model}/status", headers=headers or {}, timeout=10)
        r.raise_for_status()
        return r.json()

    def worker_stats(self) -> dict:
        return self.status()["worker"]

    def complete(
        self, prompt: list[int], n: int, model: str | None = None, **extra: object
    ) -> dict:
        """A greedy /v1/completions call over token ids, EOS banned; asserts a 200."""
        r = httpx.post(
            self.v1 + "/completions",
            json=greedy_body(model or self.model, prompt, n, **extra),
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Poll until no request is live in the gateway or the worker (aborts retire
        a step after the disconnect is seen, so this is not instant)."""

        def idle() -> bool:
            st = self.status()
            w = st["worker"]
            return w["requests"] == 0 and w["batch_rows"] == 0 and st["in_flight"] == 0

        wait_for(idle, timeout_s, "the server to go idle")


def leave_after_events(
    server: Server, content: str, events: int = 3, headers: dict[str, str] | None = None
) -> int:
    """Stream a long greedy chat completion of the tiny model, read `events`
    data events, then close the connection: a client that leaves mid-decode.
    Returns the events read (fewer only if the stream ended first)."""
    seen = 0
    with httpx.stream(
        "POST",
        f"{server.v1}/chat/completions",
        headers=headers or {},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2000,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == events:
                    break  # leaving the block closes the connection
    return seen


def decode_together(
    server: Server, route: str, bodies: list[dict], k: int
) -> tuple[list[list[int]], dict]:
    """Stream every body at once; return each one's first `k` token ids and the
    worker's stats taken while all of them were still streaming.

    Each stream reads `k` tokens, then waits at a barrier with its connection
    open, so the stats show how many rows decode side by side: proof of
    batching that does not depend on how the requests' arrivals happen to
    interleave. Leaving the block disconnects each stream (an abort).
    Bodies need a large max_tokens and suppressed EOS so no stream ends first.
    """
    arrived = threading.Barrier(len(bodies) + 1, timeout=120)
    release = threading.Event()

    def one(body: dict) -> list[int]:
        ids: list[int] = []
        try:
            with httpx.stream(
                "POST", server.v1 + route, json={**body, "stream": True}, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if len(ids) >= k:
                        # wait inside the loop: leaving the line iterator would
                        # close the connection, and the server would abort the row
                        arrived.wait()
                        release.wait(120)
                        break
        except threading.BrokenBarrierError:
            pass
        return ids[:k]

    threads_out: list[list[int]] = [[] for _ in bodies]

    def run(i: int) -> None:
        threads_out[i] = one(bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    try:
        arrived.wait()
        stats = server.worker_stats()
    finally:
        release.set()
        arrived.abort()
        for t in threads:
            t.join(120)
    return threads_out, stats


def start_server(
    model_dir: str | None,
    log_path: Path,
    *,
    model_name: str | None = None,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    timeout_s: float = 300.0,
) -> Server:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        *(["--model", model_dir] if model_dir else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if model_name:
        args += ["--model-name", model_name]
    args += extra_args or []
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    log = log_path.open("wb")
    proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    # /ready is the server's own readiness signal; poll it until it flips or the
    # process dies, with a deadline so a broken start fails instead of hanging.
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log_path.read_text()}")
        try:
            r = httpx.get(url + "/ready", timeout=2)
            if r.status_code == 200:
                return Server(url, proc, r.json()["model"], log_path)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server not ready in {timeout_s}s:\n{log_path.read_text()}")
        time.sleep(0.1)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


# A model whose tokenizer and template support tools and reasoning (Hermes/Qwen
# markers, mlx-lm's json_tools parser), served once with an API key for the API
# breadth tests (tools, reasoning, structured output, the Anthropic API).
TOOLS_KEY = "sk-tools-0123456789"


def wait_for(
    predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "", interval: float = 0.05
) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval)


def assert_serving(
    srv: Server,
    *,
    headers: dict[str, str] | None = None,
    admin_headers: dict[str, str] | None = None,
) -> None:
    """A short chat completes (200, 3 tokens), and then no request stays live."""
    r = httpx.post(
        f"{srv.v1}/chat/completions",
        json={
            "model": srv.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "temperature": 0,
        },
        headers=headers or {},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3

    def idle() -> bool:
        st = srv.status(admin_headers)
        return st["worker"]["requests"] == 0 and st["queue"]["in_flight"] == 0

    wait_for(idle, 10, "the served request to retire")
