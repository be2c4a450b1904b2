"""Slow readers: how long a write to a client may wait, and how a response is cut off.

The policy (docs/api.md#slow-readers), in three stages:

1. Bounded buffers. A response's bytes go to the kernel's socket buffer and
   then the transport's buffer; past the transport's high-water mark, aiohttp's
   `write` waits for the client to drain it. Nothing else queues bytes.
2. Coalescing. While a stream's handler waits in such a write, the tokens the
   worker keeps producing are merged into one pending delta by the request's
   collector (gateway/workers/client.RequestStream): memory stays bounded by
   max_tokens, whatever the wait.
3. Cut-off. A write that makes no progress for `slow_reader_timeout_s` raises
   `SlowReader`. Progress is what the kernel's send queue and the transport's
   buffer lose while the write waits (the client reading), so a slow but
   steady client is never cut off however long its response takes, while one
   that reads nothing, or a byte now and then (TCP does not even reopen its
   window for that), is. Where the kernel's queue cannot be read, a write
   must complete within the timeout instead. The request ends with finish
   reason `slow_reader`: the worker
   aborts it (the Generation context), a stream's terminal SSE error event and
   `[DONE]` are queued behind the output the client has not read, and the
   connection is closed; a client that still has not taken those bytes after
   another `slow_reader_timeout_s` gets a reset, so a reader that never reads
   cannot hold a socket (and its buffers) forever.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.http.app_keys import SETTINGS
from gateway.http.request_state import state

log = logging.getLogger("mlxd.gateway.slow_reader")

FINISH_REASON = "slow_reader"
_CHUNK = 64 * 1024  # a whole response is written in pieces of this size, each bounded


class SlowReader(Exception):
    """A write to the client did not complete within the slow-reader timeout."""

    def __init__(self, response: web.StreamResponse, limit_s: float) -> None:
        super().__init__(f"{FINISH_REASON}: the client did not read the response for {limit_s:g} s")
        self.response = response
        self.finish_reason = FINISH_REASON


def slow_reader_timeout_s(request: web.Request) -> float:
    """The app's slow-reader timeout."""
    return request.app[SETTINGS].slow_reader_timeout_s


async def write_bounded(
    resp: web.StreamResponse,
    data: bytes,
    limit_s: float,
    transport: asyncio.BaseTransport | None = None,
) -> None:
    """`resp.write(data)`, or SlowReader once it has waited limit_s without progress."""
    transport = transport or _transport_of(resp)
    if _takes_whole(transport, len(data)):
        await resp.write(data)
        return
    await _bounded(resp, lambda: resp.write(data), limit_s, transport)


def _takes_whole(transport: asyncio.BaseTransport | None, size: int) -> bool:
    """Whether a write of `size` bytes cannot wait for the client.

    With nothing in the transport's buffer (the kernel took every byte so
    far) and `size` under its high-water mark, the transport is not paused
    and stays unpaused after the write, so aiohttp's write returns without
    draining. That is nearly every token event of a stream whose client
    reads, and it then needs no task, timer or send-queue read: on this
    repository's 2-core CPU those were 14-33% of the gateway's CPU per
    streamed token (docs/benchmarks/README.md, session 30).
    """
    # Duck-typed: uvloop's transports are not asyncio.WriteTransport instances.
    if transport is None or transport.is_closing():
        return False
    try:
        _, high = transport.get_write_buffer_limits()  # type: ignore[attr-defined]
        return bool(transport.get_write_buffer_size() == 0 and size < high)  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


async def write_eof_bounded(
    resp: web.StreamResponse, limit_s: float, transport: asyncio.BaseTransport | None = None
) -> None:
    """`resp.write_eof()`, or SlowReader once its drain has waited limit_s without progress.

    Called once every byte of the body was written. A client that has read it all
    may hang up before the final flush returns, and aiohttp then cancels the
    handler; that answer was served, so the cancellation is absorbed here instead
    of being recorded as a client that went away (499). A cancellation while the
    connection is still open (shutdown) propagates.
    """
    transport = transport or _transport_of(resp)
    try:
        await _bounded(resp, resp.write_eof, limit_s, transport)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or (transport is not None and not transport.is_closing()):
            raise
        task.uncancel()


async def _bounded(
    resp: web.StreamResponse,
    op: Callable[[], Awaitable[None]],
    limit_s: float,
    transport: asyncio.BaseTransport | None,
) -> None:
    # The write runs as a task of its own, so that waiting for it can be
    # checked for progress and resumed, not only abandoned.
    task = asyncio.ensure_future(op())
    # Read its exception however this wait ends: a write that fails (the client's
    # connection reset) in the loop turn in which the handler is cancelled
    # finishes unread, and was logged as "Task exception was never retrieved"
    # (one error line per departed client on the H200). task.result() below
    # still raises it to a caller that is waiting.
    task.add_done_callback(_retrieve)
    transport = transport or _transport_of(resp)
    try:
        pending = _pending_bytes(transport)
        while True:
            done, _ = await asyncio.wait({task}, timeout=limit_s)
            if done:
                task.result()
                return
            now = _pending_bytes(transport)
            if now is None or pending is None or now >= pending:
                raise SlowReader(resp, limit_s)
            pending = now  # the client took some: wait on
    finally:
        if not task.done():
            # Cancelling leaves aiohttp's drain waiter cancelled: later drains on
            # this connection fail at once, which cut_off() expects.
            task.cancel()


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


def _transport_of(resp: web.StreamResponse) -> asyncio.BaseTransport | None:
    # aiohttp keeps the transport on the response's payload writer; without it
    # (another aiohttp), writes are only bounded by time, not checked for progress.
    writer = getattr(resp, "_payload_writer", None)
    transport = getattr(writer, "transport", None)
    return transport if isinstance(transport, asyncio.BaseTransport) else None


def _pending_bytes(transport: asyncio.BaseTransport | None) -> int | None:
    """Bytes written but not yet taken by the client: transport buffer + kernel send queue."""
    if transport is None or transport.is_closing():
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        kernel = _kernel_unsent(sock)
        buffered = transport.get_write_buffer_size()  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):
        return None
    return None if kernel is None else kernel + int(buffered)


def _kernel_unsent(sock: socket.socket) -> int | None:
    if sys.platform.startswith("linux"):
        import fcntl
        import termios

        # SIOCOUTQ (= TIOCOUTQ): bytes in the send queue not yet acknowledged.
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        return int(struct.unpack("i", out)[0])
    if sys.platform == "darwin":
        return int(sock.getsockopt(socket.SOL_SOCKET, 0x1024))  # SO_NWRITE
    return None


def mark_slow_reader(request: web.Request, exc: SlowReader) -> None:
    """Record the request's terminal outcome for its log line and metrics."""
    st = state(request)
    st.finish_reason = FINISH_REASON
    st.error = str(exc)
    log.warning("cutting off a slow reader: request %s: %s", st.request_id, exc)


async def cut_off(request: web.Request, resp: web.StreamResponse, final: bytes = b"") -> None:
    """End a response whose client stopped reading, without waiting for that client.

    `final` (a stream's terminal event) is queued behind what the client has
    not read, and the connection is closed: that flushes it if the client
    resumes reading; after another slow-reader timeout the connection is reset.
    The chunked body's terminator is not sent, since sending it would wait for
    the client again: after `[DONE]` a client sees the connection end.
    """
    if final:
        try:
            await resp.write(final)  # the timed-out write emptied aiohttp's count: no drain
        except (ConnectionError, RuntimeError):
            pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # a real cancellation
            # aiohttp keeps the drain waiter that the timed-out write cancelled:
            # any further drain on this connection fails at once. Nothing to do.
    transport, protocol = request.transport, request.protocol
    if transport is None:
        return
    if not transport.is_closing():
        transport.close()
    grace = slow_reader_timeout_s(request)
    asyncio.get_running_loop().call_later(grace, _reset, protocol, transport)


def _reset(protocol: asyncio.BaseProtocol, transport: asyncio.BaseTransport) -> None:
    """Reset the connection, dropping whatever the client has not read.

    A plain close of a socket with unsent data leaves the kernel sending it
    (for minutes, to a client that never reads); SO_LINGER 0 turns the close
    into a reset that frees those buffers at once.
    """
    if getattr(protocol, "transport", None) is None:
        return  # closed meanwhile (the client took everything): its fd may be reused
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(RuntimeError, OSError):
        transport.abort()  # type: ignore[attr-defined]


async def finish_bounded(request: web.Request, resp: web.Response) -> web.StreamResponse:
    """Send a whole (non-streaming) response, cutting off a client that does not read it.

    The body goes out in chunks, each bounded by the slow-reader timeout, so a
    slow but steady client gets a large body however long it takes, while one
    that stops reading is cut off. Returns the response for the handler to
    return; aiohttp's own final `write_eof` is then a no-op, or fails quietly
    on the closed connection.
    """
    body = resp.body
    if not isinstance(body, bytes | bytearray):
        return resp  # not a plain byte body: let aiohttp send it
    out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=resp.headers)
    out.content_length = len(body)
    limit = slow_reader_timeout_s(request)
    transport = request.transport
    last = False
    try:
        await out.prepare(request)
        view = memoryview(body)
        starts = range(0, len(body), _CHUNK)
        for start in starts:
            last = start == starts[-1]
            await write_bounded(out, bytes(view[start : start + _CHUNK]), limit, transport)
        await write_eof_bounded(out, limit, transport)
    except SlowReader as exc:
        mark_slow_reader(request, exc)
        await cut_off(request, out)
    except ConnectionError:
        pass  # the client went away: as when aiohttp sends the response itself
    except asyncio.CancelledError:
        # A client that read the whole body may hang up while the last write's
        # completion is still being awaited: served, not cancelled (see
        # write_eof_bounded). Only when nothing is left unsent.
        task = asyncio.current_task()
        unsent = (
            transport.get_write_buffer_size()
            if isinstance(transport, asyncio.WriteTransport)
            else 0
        )
        if (
            not last
            or task is None
            or unsent
            or (transport is not None and not transport.is_closing())
        ):
            raise
        task.uncancel()
    return out
