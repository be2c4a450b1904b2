"""gateway/http/slow_reader.py's bounded writes: pure asyncio, no server."""

from __future__ import annotations

import asyncio
import gc
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
