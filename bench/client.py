"""The load generator's HTTP client: one OpenAI chat request, timed client-side.

Owns: building a target's request body, sending it with aiohttp, parsing the
SSE stream itself (`data: ` lines; comments and keep-alives ignored), and
recording per-request stage timestamps on `time.monotonic()` (the clock the
gateway and the worker use too, so traces can be lined up): sent, first byte
(response headers), first token, every token event, done, and for cancelled
requests when the client left.

Token events: mlxd is asked for `return_token_ids`, so each SSE chunk names the
exact tokens it carries; mlx_lm.server has no such field, so each content chunk
counts as one token event (its streaming detokenizer may hold a token back and
send it with the next), and the usage chunk gives the exact total.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.workload import RequestSpec


@dataclass(slots=True)
class Target:
    """An OpenAI-compatible server under test."""

    name: str  # "mlxd" or "peer"
    url: str  # http://127.0.0.1:PORT
    model: str  # the "model" field it expects
    token_ids: bool  # supports mlxd's return_token_ids extension
    suppress_eos: list[int] = field(default_factory=list)
    status_path: str | None = None  # mlxd: /models/{model}/status (worker stats)

    def body(
        self, spec: RequestSpec, messages: list[dict[str, str]] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages if messages is not None else spec.messages,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": spec.stream,
        }
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        if self.token_ids:
            body["return_token_ids"] = True
        if self.suppress_eos:
            body["logit_bias"] = {str(t): -100.0 for t in self.suppress_eos}
        return body


@dataclass(slots=True)
class RequestRecord:
    """What one request did, on the monotonic clock."""

    id: str
    ok: bool = False
    error: str | None = None
    status: int | None = None
    sent: float = 0.0
    first_byte: float | None = None
    first_token: float | None = None
    done: float | None = None
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    tokens: int = 0
    token_ids: list[int] | None = None
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cancelled_at: float | None = None
    cancel_stage: str | None = None  # "prefill" (no token yet) or "decode"
    cancel_to_retire_s: float | None = None  # observed in the worker's stats (mlxd)
    cancel_poll_rtt_s: float | None = None
    # mlxd's own measurement (gateway: client gone -> the worker's terminal output)
    server_cancel_to_retire_s: float | None = None

    def gaps(self) -> list[float]:
        """Seconds between consecutive token events (what a reader experiences)."""
        ts = [t for t, _ in self.events]
        return [b - a for a, b in itertools.pairwise(ts)]

    def to_json(self, t0: float) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 6)

        return {
            "id": self.id,
            "ok": self.ok,
            "error": self.error,
            "status": self.status,
            "sent": rel(self.sent),
            "first_byte": rel(self.first_byte),
            "first_token": rel(self.first_token),
            "done": rel(self.done),
            "events": [[round(t - t0, 6), n] for t, n in self.events],
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cancelled_at": rel(self.cancelled_at),
            "cancel_stage": self.cancel_stage,
            "cancel_to_retire_s": self.cancel_to_retire_s,
            "cancel_poll_rtt_s": self.cancel_poll_rtt_s,
            "server_cancel_to_retire_s": self.server_cancel_to_retire_s,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        def t(v: float | None) -> float | None:
            return None if v is None else float(v)

        return cls(
            id=d["id"],
            ok=d["ok"],
            error=d.get("error"),
            status=d.get("status"),
            sent=float(d.get("sent") or 0.0),
            first_byte=t(d.get("first_byte")),
            first_token=t(d.get("first_token")),
            done=t(d.get("done")),
            events=[(float(a), int(b)) for a, b in d.get("events", [])],
            tokens=int(d.get("tokens", 0)),
            token_ids=d.get("token_ids"),
            text=d.get("text", ""),
            finish_reason=d.get("finish_reason"),
            prompt_tokens=d.get("prompt_tokens"),
            cached_tokens=d.get("cached_tokens"),
            cancelled_at=t(d.get("cancelled_at")),
            cancel_stage=d.get("cancel_stage"),
            cancel_to_retire_s=d.get("cancel_to_retire_s"),
            cancel_poll_rtt_s=d.get("cancel_poll_rtt_s"),
            server_cancel_to_retire_s=d.get("server_cancel_to_retire_s"),
        )


def make_session(limit: int = 1024, recv_buffer: int | None = None) -> aiohttp.ClientSession:
    """A loopback client session; `recv_buffer` shrinks SO_RCVBUF (slow readers)."""
    factory = None
    if recv_buffer:

        def factory(addr: Any) -> socket.socket:
            family, type_, proto, _, _ = addr
            sock = socket.socket(family=family, type=type_, proto=proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
            return sock

    try:
        connector = aiohttp.TCPConnector(limit=limit, socket_factory=factory)
    except TypeError:  # aiohttp < 3.12 has no socket_factory: default buffers
        connector = aiohttp.TCPConnector(limit=limit)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        read_bufsize=1 << 20,
    )


class _Cancel(Exception):
    """The client decided to leave."""


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    *,
    messages: list[dict[str, str]] | None = None,
    timeout_s: float = 600.0,
    prefill_cancel_after_s: float | None = None,
    on_event: Callable[[RequestRecord], None] | None = None,
    stop: asyncio.Event | None = None,
) -> RequestRecord:
    """Send one chat request and time it; never raises for server or network errors.

    `prefill_cancel_after_s`: leave that long after sending, whatever arrived (a
    server may hold its headers back until the first token, as mlxd does so that
    it can replay a request on a new worker); the record says whether a token had
    arrived. `spec.cancel_after_tokens`: leave after that many tokens. `stop`:
    leave at the next event once it is set (background streams).
    """
    rec = RequestRecord(spec.id)
    exchange = _exchange(session, target, spec, rec, messages, timeout_s, on_event, stop)
    if prefill_cancel_after_s is None:
        await exchange
        return rec
    task = asyncio.ensure_future(exchange)
    await asyncio.wait({task}, timeout=max(0.0, prefill_cancel_after_s))
    if not task.done():
        rec.cancelled_at = time.monotonic()
        rec.cancel_stage = "prefill" if rec.first_token is None else "decode"
        task.cancel()  # aiohttp closes the connection: the server sees the client leave
        await asyncio.gather(task, return_exceptions=True)
        rec.done, rec.ok, rec.error = rec.cancelled_at, True, None
    return rec


async def _exchange(
    session: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    rec: RequestRecord,
    messages: list[dict[str, str]] | None,
    timeout_s: float,
    on_event: Callable[[RequestRecord], None] | None,
    stop: asyncio.Event | None,
) -> None:
    body = target.body(spec, messages)
    headers = {"X-Request-ID": "bench-" + spec.id.replace("/", "-")}
    url = target.url + "/v1/chat/completions"
    rec.sent = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body, headers=headers) as resp:
                rec.first_byte = time.monotonic()
                rec.status = resp.status
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                elif not spec.stream:
                    _parse_full(rec, await resp.json(content_type=None))
                else:
                    try:
                        await _read_stream(rec, resp, spec, on_event, stop)
                    except _Cancel:
                        rec.cancelled_at = time.monotonic()
                        rec.cancel_stage = "prefill" if rec.first_token is None else "decode"
                        resp.close()  # drops the connection: the server sees the client leave
                        rec.ok = True
    except TimeoutError:
        rec.error = f"timed out after {timeout_s:g} s"
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.done = rec.cancelled_at or time.monotonic()


async def _read_stream(
    rec: RequestRecord,
    resp: aiohttp.ClientResponse,
    spec: RequestSpec,
    on_event: Callable[[RequestRecord], None] | None,
    stop: asyncio.Event | None,
) -> None:
    content = resp.content
    text: list[str] = []
    ids: list[int] = []
    chunk_tokens = 0
    while True:  # bounded by the server's [DONE]/EOF and the caller's timeout
        line = await content.readline()
        if not line:
            break  # EOF
        if not line.startswith(b"data: "):
            continue  # blank separators, ": keep-alive" comments
        data = line[6:].strip()
        if data == b"[DONE]":
            rec.ok = rec.error is None
            break
        now = time.monotonic()
        payload = json.loads(data)
        if "error" in payload:
            err = payload["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
            continue
        if payload.get("usage"):
            _usage(rec, payload["usage"])
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") or choice.get("text") or ""
            if "token_ids" in choice:
                n = len(choice["token_ids"] or [])
                ids.extend(int(t) for t in choice["token_ids"] or [])
            else:
                n = 1 if piece else 0
            if piece:
                text.append(piece)
            if n:
                if rec.first_token is None:
                    rec.first_token = now
                rec.events.append((now, n))
                chunk_tokens += n
                if on_event is not None:
                    on_event(rec)
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
        if (spec.cancel_after_tokens is not None and chunk_tokens >= spec.cancel_after_tokens) or (
            stop is not None and stop.is_set()
        ):
            rec.text, rec.tokens = "".join(text), chunk_tokens
            rec.token_ids = ids if ids else None
            raise _Cancel
        if spec.read_delay_s:
            await asyncio.sleep(spec.read_delay_s)
    rec.text = "".join(text)
    rec.token_ids = ids if ids else None
    # Usage (when the server sent it) is exact; otherwise count what arrived.
    if not rec.tokens:
        rec.tokens = chunk_tokens
    if rec.finish_reason is None and rec.error is None:
        rec.error = "stream ended without a finish reason"
        rec.ok = False


def _usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    rec.tokens = int(usage.get("completion_tokens") or 0)
    rec.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        rec.cached_tokens = int(details["cached_tokens"] or 0)


def _parse_full(rec: RequestRecord, payload: Any) -> None:
    if not isinstance(payload, dict) or "choices" not in payload:
        rec.error = f"unexpected response: {str(payload)[:300]}"
        return
    choice = payload["choices"][0]
    msg = choice.get("message") or {}
    rec.text = msg.get("content") or choice.get("text") or ""
    rec.finish_reason = choice.get("finish_reason")
    if "token_ids" in choice:
        rec.token_ids = [int(t) for t in choice["token_ids"]]
    if payload.get("usage"):
        _usage(rec, payload["usage"])
    if not rec.tokens and rec.token_ids is not None:
        rec.tokens = len(rec.token_ids)
    now = time.monotonic()
    rec.first_token = now  # non-streaming: everything arrives at once
    rec.events.append((now, rec.tokens))
    rec.ok = True


async def get_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> Any:
    async with asyncio.timeout(timeout_s), session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def get_text(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> str:
    async with asyncio.timeout(timeout_s), session.get(url) as resp:
        resp.raise_for_status()
        return await resp.text()
