"""The served models: a HostedModel per configured model, lazy start, idle stop, one budget.

A `HostedModel` is a configured model (gateway/config.ModelEntry) with its own
admission queue. While it runs it has a `ServedModel` (a supervised worker and a
frontend); while it is stopped it has none. `ModelRegistry` owns every hosted model and
decides when workers start and stop:

- **Pinned** models start with the gateway and are never stopped for idleness
  or memory. With no `models` list, the single `model` setting is one pinned
  entry, so a one-model server behaves as it always did.
- **Lazy** models start on their first request. The request holds a **lease**
  from before it is queued until its answer is written; a model with leases is
  never stopped. When the last lease ends, an idle timer starts; it stops the
  worker after the model's `idle_timeout_s` without a new lease.
- **Memory**: every running worker is charged its footprint (its whole memory
  budget, which its own governor enforces). A model may start only when the
  footprints fit `models_memory_budget_bytes`; to make room the registry stops
  idle, unpinned models, least recently used first. When the room is held by
  models with leases, the starting request waits (its deadline bounds the wait)
  until a lease ends, without holding the start lock, so a model that fits
  meanwhile is not held up behind it.

Hosted model states, as /models/{model}/status reports them: `stopped` (no worker; the
reason says why: not started yet, idle, evicted) -> `starting` (worker loading,
then the supervisor's states: ready, restarting, failed ...) -> `stopping` ->
`stopped`.

Threading: event loop only. Start and stop decisions are serialised by one
lock; leases are plain counters on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from gateway.config import ModelEntry, Settings
from gateway.http.errors import APIError
from gateway.serving.admission import Admission
from gateway.workers.served_model import ServedModel

log = logging.getLogger("mlxd.gateway.models")

GIB = 1 << 30


def estimate_footprint(entry: ModelEntry) -> int:
    """A worker's memory budget: configured, else weight files x 1.1 plus 1 GiB for KV."""
    if entry.memory_bytes:
        return entry.memory_bytes
    path = Path(entry.path).expanduser()
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
    return int(weights * 1.1) + GIB


def physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def not_found(name: str) -> APIError:
    return APIError(
        404, f"the model {name!r} does not exist", param="model", code="model_not_found"
    )


class HostedModel:
    def __init__(self, entry: ModelEntry, settings: Settings, footprint: int | None) -> None:
        self.entry = entry
        self.name = entry.name
        # Lazy models' workers get their footprint as their memory budget, so the
        # budget the registry charges is the one each governor enforces.
        self.settings = settings.for_model(entry, footprint)
        self.footprint = footprint or 0
        self.admission = Admission(
            settings.in_flight_cap,
            settings.max_queued,
            window_s=settings.drain_window_s,
            retry_after_min_s=settings.retry_after_min_s,
            retry_after_max_s=settings.retry_after_max_s,
        )
        self.served: ServedModel | None = None
        self.stopping = False
        self.leases = 0
        self.last_used = time.monotonic()
        self.stopped_reason = "not started yet"
        self.starts = 0
        self.created_at = time.time()
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def pinned(self) -> bool:
        return self.entry.pinned

    @property
    def running(self) -> bool:
        return self.served is not None

    @property
    def state(self) -> str:
        if self.stopping:
            return "stopping"
        if self.served is None:
            return "stopped"
        return str(self.served.supervisor.state.value)

    @property
    def phase(self) -> str:
        if self.stopping:
            return "stopping"
        return "stopped" if self.served is None else self.served.phase

    @property
    def reason(self) -> str:
        if self.served is None:
            return self.stopped_reason
        return self.served.supervisor.reason

    def sampling_defaults(self) -> dict[str, object]:
        return self.entry.sampling.defaults()


class ModelRegistry:
    def __init__(
        self,
        settings: Settings,
        worker_env: dict[str, str] | None = None,
        on_start: Callable[[ServedModel], None] | None = None,
    ) -> None:
        self.settings = settings
        self.worker_env = worker_env
        self.on_start = on_start
        entries = settings.model_entries()
        multi = bool(settings.models)
        # One model without a models list keeps its own memory_budget_bytes.
        self.hosted_models = [
            HostedModel(e, settings, estimate_footprint(e) if multi else None) for e in entries
        ]
        self.budget = settings.models_memory_budget_bytes or int(physical_memory_bytes() * 0.75)
        self._by_name = {n: s for s in self.hosted_models for n in (s.name, *s.entry.aliases)}
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()  # set (and replaced) when a lease ends or a worker stops
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # -- lookup ----------------------------------------------------------------------

    def resolve(self, name: str) -> HostedModel:
        hosted = self._by_name.get(name)
        if hosted is None:
            raise not_found(name)
        return hosted

    def get(self, name: str) -> HostedModel | None:
        return self._by_name.get(name)

    @property
    def primary(self) -> HostedModel:
        """The first configured model (what /version and one-model probes describe)."""
        return self.hosted_models[0]

    @property
    def pinned(self) -> list[HostedModel]:
        return [s for s in self.hosted_models if s.pinned]

    def used_bytes(self) -> int:
        return sum(s.footprint for s in self.hosted_models if s.running or s.stopping)

    # -- lifetime ----------------------------------------------------------------------

    def start_pinned(self) -> None:
        for hosted in self.pinned:
            self._start(hosted)
        for hosted in self.hosted_models:
            if hosted.footprint > self.budget:
                log.warning(
                    "model %s needs %d bytes, more than models_memory_budget_bytes (%d): "
                    "it cannot start",
                    hosted.name,
                    hosted.footprint,
                    self.budget,
                )

    def drain(self) -> None:
        """The gateway is shutting down: no model starts any more; running ones drain."""
        self._closed = True
        for hosted in self.hosted_models:
            if hosted.served is not None:
                hosted.served.supervisor.drain()

    async def stop_all(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for hosted in self.hosted_models:
            if hosted._idle_timer is not None:
                hosted._idle_timer.cancel()
        await asyncio.gather(
            *(self._stop(s, "gateway stopped") for s in self.hosted_models if s.served is not None)
        )

    # -- leases ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, hosted: HostedModel, deadline: float) -> AsyncIterator[ServedModel]:
        """Hold the model for one request: start it if needed; it is not stopped until
        the block exits. Raises a 503 when it cannot start before `deadline`."""
        hosted.leases += 1
        if hosted._idle_timer is not None:
            hosted._idle_timer.cancel()
            hosted._idle_timer = None
        try:
            served = hosted.served if hosted.served is not None and not hosted.stopping else None
            if served is None:
                served = await self._ensure_running(hosted, deadline)
            yield served
        finally:
            hosted.leases -= 1
            hosted.last_used = time.monotonic()
            if hosted.leases == 0:
                self._arm_idle_timer(hosted)
                self._notify()

    async def _ensure_running(self, hosted: HostedModel, deadline: float) -> ServedModel:
        while True:
            async with self._lock:
                if hosted.served is not None:
                    return hosted.served
                if self._closed:
                    raise APIError(503, "the server is shutting down", code="model_not_ready")
                if hosted.footprint > self.budget - self._pinned_bytes(exclude=hosted):
                    raise APIError(
                        503,
                        f"the model {hosted.name!r} needs {hosted.footprint} bytes of memory; "
                        f"the models' budget is {self.budget} bytes",
                        code="model_too_large",
                    )
                victims = self._room_for(hosted)
                if victims is not None:
                    for v in victims:
                        await self._stop(v, f"stopped to make room for {hosted.name}")
                    return self._start(hosted)
                # Wait outside the lock: another model that fits may start meanwhile.
                changed = self._changed
            await self._wait_for_room(hosted, changed, deadline)

    def _pinned_bytes(self, exclude: HostedModel) -> int:
        return sum(s.footprint for s in self.hosted_models if s.pinned and s is not exclude)

    def _room_for(self, hosted: HostedModel) -> list[HostedModel] | None:
        """The idle models to stop so `hosted` fits (least recently used first), or None."""
        free = self.budget - self.used_bytes()
        victims: list[HostedModel] = []
        idle = sorted(
            (s for s in self.hosted_models if s.running and not s.pinned and s.leases == 0),
            key=lambda s: s.last_used,
        )
        for s in idle:
            if free >= hosted.footprint:
                break
            victims.append(s)
            free += s.footprint
        return victims if free >= hosted.footprint else None

    async def _wait_for_room(
        self, hosted: HostedModel, changed: asyncio.Event, deadline: float
    ) -> None:
        """Until a lease ends or a worker stops (`changed`), or a 503 at the deadline."""
        busy = [s.name for s in self.hosted_models if s.running and s.leases > 0]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise APIError(
                503,
                f"no memory to start {hosted.name!r}: in use by models serving requests "
                f"({', '.join(busy)})",
                code="model_not_ready",
                headers={"Retry-After": "5"},
            )
        log.info("model %s waits for memory held by %s", hosted.name, ", ".join(busy))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), remaining)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- start and stop ----------------------------------------------------------------

    def _start(self, hosted: HostedModel) -> ServedModel:
        served = ServedModel(hosted.settings, self.worker_env)
        if self.on_start is not None:
            self.on_start(served)
        hosted.served = served
        hosted.starts += 1
        log.info("starting model %s (footprint %d bytes)", hosted.name, hosted.footprint)
        served.start()
        return served

    async def _stop(self, hosted: HostedModel, reason: str) -> None:
        served = hosted.served
        if served is None:
            return
        hosted.served, hosted.stopping, hosted.stopped_reason = None, True, reason
        log.info("stopping model %s: %s", hosted.name, reason)
        try:
            await served.stop()
        finally:
            hosted.stopping = False
            self._notify()

    def _arm_idle_timer(self, hosted: HostedModel) -> None:
        timeout = hosted.entry.idle_timeout_s
        if hosted.pinned or timeout <= 0 or hosted.served is None or self._closed:
            return
        loop = asyncio.get_running_loop()
        hosted._idle_timer = loop.call_later(timeout, self._spawn, self._idle_stop(hosted))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _idle_stop(self, hosted: HostedModel) -> None:
        async with self._lock:
            hosted._idle_timer = None
            idle_for = time.monotonic() - hosted.last_used
            # A lease that came and went while this waited for the lock armed a
            # newer timer: leave the stop to that one.
            if (
                hosted.leases == 0
                and hosted.served is not None
                and idle_for >= 0.99 * hosted.entry.idle_timeout_s
            ):
                await self._stop(hosted, f"idle for {hosted.entry.idle_timeout_s:g} s")
