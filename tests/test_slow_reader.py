"""gateway/http/slow_reader.py's bounded writes: pure asyncio, no server."""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

import pytest

from gateway.http.slow_reader import _bounded


async def test_a_write_that_fails_as_its_handler_is_cancelled_is_not_logged() -> None:
    # The H200 run's gateway log held "Task exception was never retrieved ...
    # write_eof() ... ClientConnectionResetError": the write failed (the client
    # hung up) in the same loop turn in which aiohttp cancelled the handler, so
    # the handler left the wait with CancelledError and a *finished* write task
    # whose exception no one ever read.
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    started = asyncio.Event()

    async def write() -> None:
        started.set()
        raise ConnectionResetError("Cannot write to closing transport")

    try:
        handler = asyncio.ensure_future(_bounded(None, write, 5.0, None))  # type: ignore[arg-type]
        await started.wait()  # the write has failed; the handler's wait has not resumed yet
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        del handler
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported


async def test_a_failed_write_still_raises_to_its_caller() -> None:
    async def write() -> None:
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError):
        await _bounded(None, write, 5.0, None)  # type: ignore[arg-type]


async def _takes_whole_on_a_stalled_connection() -> list[bool]:
    """`_takes_whole` over a real loopback connection whose peer never reads."""
    from gateway.http.slow_reader import _takes_whole

    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    transport, _ = await loop.create_connection(
        asyncio.Protocol, "127.0.0.1", listener.getsockname()[1]
    )
    peer, _ = listener.accept()  # connected already: the backlog held it; never read
    try:
        _, high = transport.get_write_buffer_limits()
        seen = [_takes_whole(transport, 200), _takes_whole(transport, high)]
        # The peer reads nothing: the kernel's buffers fill, then the transport's.
        chunk = b"x" * 65536
        for _ in range(1024):
            if transport.get_write_buffer_size():
                break
            transport.write(chunk)
            await asyncio.sleep(0)
        seen.append(_takes_whole(transport, 200))
        transport.close()
        seen.append(_takes_whole(transport, 200))
        return seen
    finally:
        transport.abort()
        peer.close()
        listener.close()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_only_a_write_the_transport_takes_whole_skips_the_bound(loop_kind: str) -> None:
    # The fast path of write_bounded: an empty transport buffer and a write under
    # its high-water mark cannot wait on the client. Anything else (a write as big
    # as the mark, a buffer the client has left unread, a closing connection)
    # goes through _bounded, which cuts a non-reader off.
    if loop_kind == "uvloop":
        import uvloop

        seen = uvloop.run(_takes_whole_on_a_stalled_connection())
    else:
        seen = asyncio.run(_takes_whole_on_a_stalled_connection())
    assert seen == [True, False, False, False]
