"""The arrival window: a wave of requests reaches an idle worker together.

Clients often send several requests at once (an agent's parallel calls, a
benchmark's wave). The gateway tokenizes them one by one in its pool, so
without this gate the first reaches the worker alone, the worker starts a
prefill step for it at once, and the rest wait for that step before their own
prefill begins: on the H200 (issue #12, session 5) mlxd's TTFT at 4-8
concurrent requests was twice its in-process engine's, which receives a wave
at once.

`ArrivalGate` counts the model's requests that are being prepared
(template, tokens). A request ready to submit while the worker has nothing in
flight, and while others are still being prepared, waits for them, at most
`window_s`; every request that becomes ready meanwhile leaves the gate at the
same moment (one shared window), the wave's last request with them, so their
Adds reach the worker side by side; the worker's own quiet period
(`arrival_quiet_s`, worker/proc.py) then admits them in one step. A lone
request (nothing else being prepared, no window open) and any request while
the worker is busy (the worker admits what arrived during its step at the next
one anyway) pass without waiting.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class ArrivalGate:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._preparing = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._window: asyncio.Future[None] | None = None
        self.held = 0  # requests that waited in a window (for tests and metrics)

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Around one request's preparation (success or failure alike)."""
        self._preparing += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._preparing -= 1
            if self._preparing == 0:
                self._quiet.set()

    async def pass_through(self, worker_idle: bool) -> None:
        """Wait, if this request should, for the wave it belongs to (module doc)."""
        if not worker_idle or self.window_s <= 0:
            return
        if self._preparing == 0 and self._window is None:
            return
        # The wave's last request (nothing left being prepared) joins the open
        # window too: passing at once, it reached the worker a few loop turns
        # before the rest, which then waited a whole step (H200, session 7).
        self.held += 1
        if self._window is None:
            self._window = asyncio.ensure_future(self._close_window())
        # shield: one waiter's cancellation (its client left) must not end the window
        await asyncio.shield(self._window)

    async def _close_window(self) -> None:
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.window_s):
                    await self._quiet.wait()
        finally:
            self._window = None
