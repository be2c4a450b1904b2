"""Server-sent events: the one SSE encoder, the SSE response, and one stream's writer.

`sse_event` is the only place an SSE frame is encoded: OpenAI's `data:` chunks,
Anthropic's named events and the slow-reader's terminal event all go through it.
`SSEStream` owns one streamed response: its headers go out lazily, every write is
bounded by the slow-reader timeout (gateway/http/slow_reader.py), one writer
writes at a time, and one keep-alive loop writes comment lines (which SSE
parsers, the OpenAI SDK's included, ignore) whenever nothing else was written for
`interval` seconds, so clients and proxies do not time out on a silent
connection: first while a stopped model starts, then while a generation has no
token yet (long prefills, queue waits in the worker).

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.http.errors import error_body
from gateway.http.slow_reader import (
    FINISH_REASON,
    SlowReader,
    slow_reader_timeout_s,
    write_bounded,
    write_eof_bounded,
)

DONE = "[DONE]"
KEEPALIVE = b": keep-alive\n\n"
KEEPALIVE_STARTING = b": keep-alive (model starting)\n\n"


def sse_event(payload: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE frame: `event: NAME` (when named), then `data: JSON` (or a bare string)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


def slow_reader_event(exc: SlowReader) -> bytes:
    """The terminal SSE event of a cut-off OpenAI stream, and `[DONE]`."""
    return sse_event(error_body(408, str(exc), code=FINISH_REASON)) + sse_event(DONE)


def sse_response() -> web.StreamResponse:
    """An unprepared Server-Sent Events response (no caching, no proxy buffering)."""
    return web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )


class SSEStream:
    """One stream's writes: headers sent lazily, keep-alive comments, one writer at a time.

    Two phases. Before `begin`, only keep-alive comments can go out (a model is
    starting); they prepare the response, so a later failure can no longer be an
    HTTP status: `fail_early` then ends the stream with the API's error event.
    After `begin(first, on_first_byte)`, the first write (data or keep-alive)
    sends the headers and `first` (OpenAI's role chunk, Anthropic's
    message_start) before its own bytes. Until then nothing of the answer has
    reached the client, so a failure is still a plain HTTP error and a worker
    restart can still replay the request (gateway/serving/generation).
    """

    def __init__(self, request: web.Request, interval: float) -> None:
        self.request = request
        self.resp = sse_response()
        self.interval = interval
        # Every write is bounded; after one timed out, the rest fail at once.
        self.slow_reader_s = slow_reader_timeout_s(request)
        self.cut: SlowReader | None = None
        self.started = False  # the answer's first bytes went out
        self.last = time.monotonic()
        self._first: bytes | None = None  # None: not begun
        self._on_first_byte: Callable[[], None] = lambda: None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def begin(self, first: bytes, on_first_byte: Callable[[], None]) -> None:
        """The answer starts: `first` precedes its first write, which calls `on_first_byte`."""
        self._first = first
        self._on_first_byte = on_first_byte

    def keep_alive(self, comment: bytes = KEEPALIVE) -> None:
        """Run the keep-alive loop (replacing a running one) with this comment line."""
        self.stop()
        if self.interval > 0:
            self._task = asyncio.get_running_loop().create_task(self._keepalive(comment))

    def stop(self) -> None:
        """Stop the keep-alive loop. No await: this also runs while a handler is cancelled."""
        if self._task is not None:
            self._task.cancel()

    async def stopped(self) -> None:
        """Stop the keep-alive loop and wait until it has."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def write(self, data: bytes) -> None:
        async with self._lock:
            if self.cut is not None:
                raise self.cut
            try:
                if not self.started:
                    if not self.resp.prepared:  # keep-alives may have begun it
                        await self.resp.prepare(self.request)
                    if self._first:
                        await write_bounded(self.resp, self._first, self.slow_reader_s)
                    self._on_first_byte()
                    self.started = True
                await write_bounded(self.resp, data, self.slow_reader_s, self.request.transport)
            except SlowReader as e:
                self.cut = e
                raise
            self.last = time.monotonic()

    async def end(self) -> web.StreamResponse:
        """The stream's last bytes are written: finish the chunked body."""
        self.stop()
        await write_eof_bounded(self.resp, self.slow_reader_s)
        return self.resp

    async def fail_early(self, event: bytes) -> bool:
        """End a stream that keep-alives prepared before the answer began with `event`.

        False when nothing was sent yet: the caller answers with a plain HTTP error.
        """
        await self.stopped()
        if not self.resp.prepared:
            return False
        with contextlib.suppress(ConnectionError, RuntimeError, SlowReader):
            await write_bounded(self.resp, event, self.slow_reader_s)
            await write_eof_bounded(self.resp, self.slow_reader_s)
        return True

    async def _comment(self, comment: bytes) -> None:
        if self._first is not None:
            await self.write(comment)  # the answer began: headers and `first` go first
            return
        async with self._lock:
            if not self.resp.prepared:
                await self.resp.prepare(self.request)
            await write_bounded(self.resp, comment, self.slow_reader_s)
            self.last = time.monotonic()

    async def _keepalive(self, comment: bytes) -> None:
        try:
            while True:
                await asyncio.sleep(max(0.01, self.last + self.interval - time.monotonic()))
                if time.monotonic() - self.last >= self.interval:
                    await self._comment(comment)
        except (ConnectionError, RuntimeError, SlowReader):
            return  # the client went away, stopped reading, or the response ended
