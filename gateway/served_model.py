"""A served model: its supervisor (worker process) and its text frontend.

Threading: event loop only; the tokenizer is loaded in a thread once the
worker reported which model files it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from gateway.config import Settings
from gateway.errors import APIError
from gateway.frontend import Frontend
from gateway.supervisor import Supervisor, WorkerState
from gateway.worker_client import WorkerClient

log = logging.getLogger("mlxd.gateway.model")


class ServedModel:
    def __init__(self, settings: Settings, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.supervisor = Supervisor(settings, extra_env)
        self.frontend: Frontend | None = None
        self.ready = asyncio.Event()
        self.created_at = time.time()
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str | None:
        client = self.supervisor.client
        return client.ready.model_id if client is not None else None

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
        self._task = asyncio.get_running_loop().create_task(self._load_frontend())

    async def _load_frontend(self) -> None:
        await self.supervisor.ready_event.wait()
        client = self.supervisor.client
        assert client is not None
        r = client.ready
        self.frontend = await asyncio.to_thread(
            Frontend, r.model_path, list(r.eos_token_ids), self.settings.tokenizer_threads
        )
        self.ready.set()
        log.info("serving %s", r.model_id)

    def client_or_503(self) -> WorkerClient:
        client = self.supervisor.client
        if not self.ready.is_set() or client is None or client.closed:
            reason = self.supervisor.reason or f"model is {self.phase.replace('_', ' ')}"
            raise APIError(503, f"the model is not ready: {reason}", code="model_not_ready",
                           headers={"Retry-After": "5"})
        return client

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.supervisor.stop()
        if self.frontend is not None:
            self.frontend.close()
