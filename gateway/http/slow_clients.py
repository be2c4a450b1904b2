"""Slow clients: how long a connection may take to send its request, and how many there may be.

A client that opens connections and sends its request slowly (or never) must
not hold a descriptor and a handler forever (docs/reliability.md, #13 finding 6).
Three bounds, each before authentication matters:

1. Headers. A connection must deliver its request's headers within
   `header_timeout_s` of connecting or of its previous response; an idle
   keep-alive connection is closed after the same time. This is aiohttp's
   keep-alive timer (`keepalive_timeout`), which starts when the connection is
   made, is not reset by incoming bytes, and closes a handler still waiting
   for a complete request.
2. Body. A body must arrive at `body_min_bytes_per_s` after a grace of
   `body_timeout_s`: by time t since its headers, at least
   (t - body_timeout_s) x rate bytes. So a 6 MB body on a fast link is read
   whole, while `Content-Length: 1000` and one byte, or a chunked body that
   trickles forever, is cut off with a 408 and the connection is closed.
   Unauthenticated requests are answered (401) without reading their body;
   aiohttp then discards what follows for at most `lingering_time` (bounded
   here by the header timeout) and closes.
3. Connections. At most `max_connections` at a time; a connection over the
   cap is closed at once, before a byte of it is read.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_runner import GracefulExit

from gateway.config import Settings
from gateway.http.app_keys import SETTINGS
from gateway.http.errors import APIError
from gateway.http.request_state import state, state_or_none

log = logging.getLogger("mlxd.gateway.slow_clients")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def handler_args(settings: Settings) -> dict[str, Any]:
    """aiohttp RequestHandler arguments: the header timeout, a bounded lingering close."""
    header_s = settings.header_timeout_s
    return {"keepalive_timeout": header_s, "lingering_time": min(5.0, header_s)}


async def read_body_bounded(request: web.Request, timeout_s: float, min_rate: float) -> bytes:
    """request.read() (cached for the handler), or a 408 once the body falls behind
    `min_rate` bytes/s after a grace of `timeout_s` (413 past client_max_size)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    read = asyncio.ensure_future(request.read())
    try:
        while True:
            received = request.content.total_bytes
            remaining = start + timeout_s + received / min_rate - loop.time()
            if remaining <= 0:
                break
            done, _ = await asyncio.wait({read}, timeout=remaining)
            if done:
                return read.result()
    finally:
        if not read.done():
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await read
    state(request).close_connection = True
    expected = request.content_length
    of = f" of {expected}" if expected is not None else ""
    raise APIError(
        408,
        f"the request body arrived too slowly: {request.content.total_bytes}{of} bytes after "
        f"{loop.time() - start:.1f} s (at least {min_rate:g} bytes/s after {timeout_s:g} s)",
        code="request_timeout",
    )


@web.middleware
async def body_deadline_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read every request body up front, at the minimum rate (after authentication:
    an unauthenticated body is never read)."""
    if request.body_exists and request.method in ("POST", "PUT", "PATCH"):
        s = request.app[SETTINGS]
        await read_body_bounded(request, s.body_timeout_s, s.body_min_bytes_per_s)
    return await handler(request)


async def close_if_asked(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a request cut off mid-body closes its connection."""
    st = state_or_none(request)
    if st is not None and st.close_connection:
        response.force_close()


class _Refused(asyncio.Protocol):
    """A connection over the cap: closed before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _CappedFactory:
    """aiohttp's protocol factory, refusing connections past `cap`."""

    def __init__(self, server: web.Server, cap: int) -> None:
        self._server = server
        self._cap = cap
        self._last_warning = 0.0
        self.refused = 0

    def __call__(self) -> asyncio.Protocol:
        if len(self._server.connections) >= self._cap:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_warning > 10:  # one line per 10 s, not one per connection
                self._last_warning = now
                log.warning(
                    "connection cap (%d) reached: refusing connections (%d so far)",
                    self._cap,
                    self.refused,
                )
            return _Refused()
        return self._server()


class CappedTCPSite(web.TCPSite):
    """web.TCPSite whose listener refuses connections past `max_connections`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, cap: int) -> None:
        super().__init__(runner, host, port)
        self._cap = cap

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            _CappedFactory(server, self._cap),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


async def _serve(app: web.Application, settings: Settings, **runner_kwargs: Any) -> None:
    # handle_signals: SIGTERM/SIGINT raise GracefulExit, as under web.run_app.
    runner = web.AppRunner(app, handle_signals=True, **runner_kwargs, **handler_args(settings))
    await runner.setup()
    try:
        cap = settings.max_connections
        site = CappedTCPSite(runner, settings.host, settings.port, cap)
        await site.start()
        print(f"======== Running on {site.name} ========", file=sys.stderr, flush=True)
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()


def run(
    app: web.Application, settings: Settings, loop: asyncio.AbstractEventLoop, **kwargs: Any
) -> None:
    """web.run_app, with the capped listener and the slow-client timeouts.

    kwargs go to web.AppRunner (handler_cancellation, shutdown_timeout,
    access_log). SIGTERM and SIGINT end it (the runner's GracefulExit).
    """
    main = loop.create_task(_serve(app, settings, **kwargs))
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in rest:
            t.cancel()
        if rest:
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
