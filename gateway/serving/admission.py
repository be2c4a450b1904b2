"""Admission: per-model caps on queued and in-flight requests, and per-key rate limits.

`Admission` owns two counts for one served model:
- in flight: requests holding a slot, i.e. a `Generation` submitted to the worker;
- queued: requests accepted but not yet holding a slot (tokenizing, or waiting).

`enter()` runs before the request is tokenized: when in flight + queued already
fill `max_in_flight + max_queued`, it raises a 503 at once with a Retry-After
derived from the measured drain rate (slots freed per second over a sliding
window), bounded to [retry_after_min_s, retry_after_max_s]. Otherwise it returns
a `Ticket`; `await ticket.acquire()` waits (FIFO) for a slot, and
`ticket.release()` frees it. Release is idempotent and also correct for a ticket
whose waiter was cancelled, so a disconnect can never leak a slot.

`RateLimiter` is a token bucket per API key: `check()` returns 0 when the
request may proceed, else the seconds until it may (429 + Retry-After).

Threading: event loop only; no locks, because nothing here awaits between
reading and updating a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass

from gateway.http.errors import APIError


class DrainRate:
    """Completions per second over a sliding window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[float] = deque()
        self._since = time.monotonic()

    def record(self, now: float) -> None:
        self._events.append(now)
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0
        # Right after start the window is not full yet: divide by what was observed.
        span = max(1.0, min(self.window_s, now - self._since))
        return len(self._events) / span

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        events = self._events
        while events and events[0] < cutoff:
            events.popleft()


class Admission:
    def __init__(
        self,
        max_in_flight: int,
        max_queued: int,
        *,
        window_s: float = 30.0,
        retry_after_min_s: int = 1,
        retry_after_max_s: int = 60,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.retry_after_min_s = retry_after_min_s
        self.retry_after_max_s = retry_after_max_s
        self.in_flight = 0
        self.queued = 0
        self.drain = DrainRate(window_s)
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def capacity(self) -> int:
        return self.max_in_flight + self.max_queued

    @property
    def open(self) -> bool:
        """Whether a new request would be accepted now."""
        return self.in_flight + self.queued < self.capacity

    def retry_after(self, now: float | None = None) -> int:
        """Seconds until the requests ahead of a new one have likely drained."""
        rate = self.drain.rate(now)
        if rate <= 0:
            # Nothing retired within the window: we cannot promise anything soon.
            return self.retry_after_max_s
        seconds = math.ceil((self.queued + 1) / rate)
        return max(self.retry_after_min_s, min(self.retry_after_max_s, seconds))

    def enter(self) -> Ticket:
        """Take a queue position, or raise 503 (with Retry-After) when full."""
        if not self.open:
            retry = self.retry_after()
            raise APIError(
                503,
                f"the server is at capacity ({self.in_flight} in flight, {self.queued} "
                f"queued); retry after {retry} s",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            )
        self.queued += 1
        return Ticket(self)

    # -- slot bookkeeping (called by Ticket) --------------------------------------

    def _take_slot(self) -> None:
        self.in_flight += 1

    def _free_slot(self, now: float) -> None:
        self.in_flight -= 1
        self.drain.record(now)
        self._wake_next()

    def _wake_next(self) -> None:
        while self._waiters and self.in_flight < self.max_in_flight:
            fut = self._waiters.popleft()
            if not fut.done():
                # The slot is handed over here, so no later arrival can take it first.
                self._take_slot()
                fut.set_result(None)
                return


@dataclass(slots=True)
class Ticket:
    """One request's place: queued until `acquire()` returns, then holding a slot."""

    admission: Admission
    state: str = "queued"  # queued -> admitted -> released
    admitted_at: float | None = None

    async def acquire(self) -> None:
        adm = self.admission
        if self.state != "queued":
            raise RuntimeError(f"ticket is {self.state}")
        if adm.in_flight < adm.max_in_flight and not adm._waiters:
            adm._take_slot()
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            adm._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    adm._free_slot(time.monotonic())  # granted as we were cancelled
                else:
                    # Drop it now: a stale entry would make later arrivals queue
                    # behind nobody while slots are free.
                    with contextlib.suppress(ValueError):
                        adm._waiters.remove(fut)
                adm.queued -= 1
                self.state = "released"
                raise
        adm.queued -= 1
        self.state = "admitted"
        self.admitted_at = time.monotonic()

    def release(self) -> None:
        """Give back the slot or queue position; idempotent."""
        adm = self.admission
        if self.state == "admitted":
            adm._free_slot(time.monotonic())
        elif self.state == "queued":
            adm.queued -= 1
        self.state = "released"


class RateLimiter:
    """Token buckets keyed by API key label."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # label -> (tokens, at)

    def check(self, label: str, rpm: float, burst: int, now: float | None = None) -> float:
        """0.0 if one request may pass now (and take a token), else seconds to wait."""
        if rpm <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        per_s = rpm / 60.0
        cap = float(burst or max(1, math.ceil(per_s * 10)))
        tokens, at = self._buckets.get(label, (cap, now))
        tokens = min(cap, tokens + (now - at) * per_s)
        if tokens >= 1.0:
            self._buckets[label] = (tokens - 1.0, now)
            return 0.0
        self._buckets[label] = (tokens, now)
        return (1.0 - tokens) / per_s
