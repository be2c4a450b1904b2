"""A served model: its supervisor (worker process) and its text frontend.

`ready` is set while a worker is READY and the tokenizer is loaded; it clears
when the worker is lost and sets again after a restart. Requests that arrive
while the worker (re)starts wait in `acquire_client` instead of failing.

Threading: event loop only; the tokenizer is loaded in a thread. When the
configured model is a local directory it loads beside the worker's own start
(the worker reports the same files and EOS ids in Ready, or it is loaded again
for what the worker reported); otherwise once the worker reported its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from pathlib import Path
from typing import Any

from gateway.config import Settings
from gateway.http.errors import APIError
from gateway.serving.arrivals import ArrivalGate
from gateway.serving.tokenizer import Frontend
from gateway.serving.tokenizer import preload as preload_tokenizer
from gateway.workers.client import WorkerClient
from gateway.workers.supervisor import Supervisor, WorkerState

log = logging.getLogger("mlxd.gateway.model")

_GONE = (WorkerState.FAILED, WorkerState.STOPPED, WorkerState.DRAINING)


class ServedModel:
    def __init__(self, settings: Settings, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.supervisor = Supervisor(settings, extra_env)
        self.frontend: Frontend | None = None
        self.ready = asyncio.Event()
        # Outlives worker restarts: it counts the gateway's own requests.
        self.arrivals = ArrivalGate(settings.arrival_window_s)
        self.created_at = time.time()
        self._name: str | None = None
        self._identity: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._preload: asyncio.Task[None] | None = None
        self._early: asyncio.Task[Frontend] | None = None  # built beside the worker's start

    @property
    def name(self) -> str | None:
        """The served id (known once a worker was first ready; kept across restarts)."""
        return self._name

    @property
    def phase(self) -> str:
        if self.ready.is_set():
            return "ready"
        state = self.supervisor.state
        if state == WorkerState.READY:
            return "loading_tokenizer"
        return "loading_model" if state == WorkerState.STARTING else state.value

    def start(self) -> None:
        self.supervisor.start()
        loop = asyncio.get_running_loop()
        # The tokenizer stack's import (mlx-lm, transformers: 9-13 s on the H200
        # machine) and the tokenizer's load (5 s for the benchmark's shapes
        # there) overlap the worker's own start instead of following it.
        model_dir = Path(self.settings.model)
        if (model_dir / "config.json").is_file():
            threads = self.settings.tokenizer_threads
            self._early = loop.create_task(
                asyncio.to_thread(Frontend, str(model_dir), None, threads)
            )
            self._early.add_done_callback(_preload_done)
        else:
            self._preload = loop.create_task(asyncio.to_thread(preload_tokenizer))
            self._preload.add_done_callback(_preload_done)
        self._task = loop.create_task(self._follow_worker())

    async def _early_frontend(self, model_path: str, eos: list[int]) -> Frontend | None:
        """The frontend built beside the worker's start, if it is for what the
        worker reported (same files, same EOS ids); None otherwise."""
        task, self._early = self._early, None
        if task is None:
            return None
        try:
            frontend = await task
        except Exception:  # logged by _preload_done; the load below reports it again
            return None
        same_dir = frontend.model_path.resolve() == Path(model_path).resolve()
        if same_dir and frontend.eos_token_ids == frozenset(eos):
            log.info("tokenizer loaded beside the worker's start")
            return frontend
        frontend.close()
        return None

    async def _follow_worker(self) -> None:
        sup = self.supervisor
        while True:
            await sup.ready_event.wait()
            client = sup.client
            assert client is not None
            r = client.ready
            if self.frontend is None or self._identity != r.identity:
                eos = list(r.eos_token_ids)
                frontend = await self._early_frontend(r.model_path, eos)
                if frontend is None:
                    frontend = await asyncio.to_thread(
                        Frontend, r.model_path, eos, self.settings.tokenizer_threads
                    )
                if self.frontend is not None:
                    self.frontend.close()
                self.frontend, self._identity = frontend, r.identity
                _freeze_heap()
            self._name = r.model_id
            if not client.closed:
                self.ready.set()
                log.info("serving %s (epoch %d)", r.model_id, r.epoch)
                await client.lost.wait()
            self.ready.clear()
            # Wait for the supervisor to notice before looking at ready_event again.
            while sup.ready_event.is_set() and sup.client is client:
                await asyncio.sleep(0.01)

    def client_or_503(self) -> WorkerClient:
        """The live client now, or a 503 (for routes that must not wait)."""
        client = self.supervisor.client
        if not self.ready.is_set() or client is None or client.closed:
            raise self._unavailable()
        return client

    async def acquire_client(self, timeout_s: float) -> WorkerClient:
        """The live client; while the worker (re)starts, wait for it up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            client = self.supervisor.client
            if self.ready.is_set() and client is not None and not client.closed:
                return client
            if self.supervisor.state in _GONE:
                raise self._unavailable()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._unavailable()
            # Wake on readiness, or on any worker state change: a worker that
            # fails to load must answer the waiting requests now, not at their
            # deadline.
            waits = {
                asyncio.ensure_future(self.ready.wait()),
                asyncio.ensure_future(self.supervisor.state_changed.wait()),
            }
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when this request is cancelled: no waiter left behind
                for task in waits:
                    task.cancel()

    def _unavailable(self) -> APIError:
        reason = self.supervisor.reason or f"model is {self.phase.replace('_', ' ')}"
        retry = 5
        retry_in = self.supervisor.retry_in_s()
        if retry_in is not None:  # FAILED, with a start attempt scheduled
            reason += f"; the next start attempt is in {retry_in:.0f} s"
            retry = max(1, round(retry_in))
        return APIError(
            503,
            f"the model is not ready: {reason}",
            code="model_not_ready",
            headers={"Retry-After": str(retry)},
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._early is not None:  # its thread finishes on its own; nothing uses it
            self._early.cancel()
        self.ready.clear()
        await self.supervisor.stop()
        if self.frontend is not None:
            self.frontend.close()


def _preload_done(task: asyncio.Task[Any]) -> None:
    """A failed preload is only a warning: the Frontend's own load, when the worker
    is ready, imports again and reports the real error."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.warning("tokenizer preload failed: %s", e)


def _freeze_heap() -> None:
    """Take what is alive now (the imports, the app, every loaded tokenizer)
    out of the cyclic collector's sight, once a model's frontend is loaded.
    A full collection otherwise walks all of it: on this CPU about 110,000
    objects in 30-40 ms, a stall of the event loop and of every stream's
    next event, every few seconds under load. Unfrozen and collected first,
    so a replaced frontend's cycles are freed, not frozen for good."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
