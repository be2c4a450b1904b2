"""Starts the worker process, performs the handshake, and stops it.

State machine of one worker:

    STARTING --(Ready)--> READY --(stop)--> STOPPED
        |                   |
        +--(Failed / exit)--+--> FAILED

Threading: event loop only. The worker is a fresh interpreter (`python -m
worker`), never a fork of the gateway, on a Unix socket inside a private
directory (0700) that only the service user can enter. A random token passed
in the worker's environment authenticates the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gateway.config import Settings
from gateway.worker_client import WorkerClient, WorkerUnavailable
from protocol import exit_codes
from protocol.frames import PROTOCOL_VERSION
from protocol.messages import Hello, Shutdown
from worker.config import TOKEN_ENV, WorkerConfig

log = logging.getLogger("mlxd.gateway.supervisor")


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    STOPPED = "stopped"
    FAILED = "failed"


class Supervisor:
    def __init__(self, settings: Settings, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.state = WorkerState.STARTING
        self.reason = ""
        self.client: WorkerClient | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.epoch = 0
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self.ready_event = asyncio.Event()
        self._extra_env = extra_env or {}
        self._dir = Path(tempfile.mkdtemp(prefix="mlxd-"))  # mkdtemp makes it 0700
        self._task: asyncio.Task[None] | None = None

    @property
    def socket_path(self) -> str:
        return str(self._dir / f"worker-{self.epoch}.sock")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._start_worker())

    async def _start_worker(self) -> None:
        s = self.settings
        self.epoch += 1
        self.state = WorkerState.STARTING
        token = secrets.token_hex(16)
        config = WorkerConfig(
            socket=self.socket_path,
            model=s.model,
            model_id=s.model_name,
            epoch=self.epoch,
            cache_dir=s.cache_dir,
            max_batch=s.max_batch,
            prefill_batch=s.prefill_batch,
            prefill_chunk=s.prefill_chunk,
            pacing=s.prefill_pacing,
            heartbeat_s=s.worker_heartbeat_s,
        )
        env = dict(os.environ, **self._extra_env)
        env[TOKEN_ENV] = token
        env.setdefault("PYTHONUNBUFFERED", "1")
        preload = _openblas_preload()
        if preload and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = preload
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker", *config.to_argv(), env=env
        )
        log.info("worker started: pid %d, epoch %d", self.process.pid, self.epoch)
        try:
            self.client = await self._connect(Hello(PROTOCOL_VERSION, self.epoch, token))
        except (WorkerUnavailable, OSError, TimeoutError, Exception) as e:
            await self._fail(str(e) or type(e).__name__)
            return
        ready = self.client.ready
        self.state = WorkerState.READY
        self.ready_at = time.monotonic()
        self.reason = ""
        log.info(
            "worker ready: model %s (%s) backend=%s blas=%s load=%.2fs context=%d",
            ready.model_id, ready.identity, ready.backend, ready.blas, ready.load_time_s,
            ready.context_length,
        )
        self.ready_event.set()

    async def _connect(self, hello: Hello) -> WorkerClient:
        """Connect once the worker listens; give up if it exits first."""
        assert self.process is not None
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        exited = asyncio.ensure_future(self.process.wait())
        try:
            while True:
                if exited.done():
                    code = exited.result()
                    raise WorkerUnavailable(f"worker {exit_codes.describe(code)} during startup")
                if Path(self.socket_path).exists():
                    connect = asyncio.ensure_future(
                        WorkerClient.connect(
                            self.socket_path, hello, deadline - time.monotonic(), self._lost
                        )
                    )
                    done, _ = await asyncio.wait(
                        {connect, exited}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if connect in done:
                        return connect.result()
                    connect.cancel()
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError("worker did not start in time")
                # The socket appears before the model loads; poll for it briefly.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), 0.05)
        finally:
            if not exited.done():
                exited.cancel()

    def _lost(self, reason: str) -> None:
        if self.state == WorkerState.READY:
            log.error("worker connection lost: %s", reason)
            self.state = WorkerState.FAILED
            self.reason = reason
            self.ready_event.clear()

    async def _fail(self, reason: str) -> None:
        log.error("worker failed: %s", reason)
        self.state = WorkerState.FAILED
        self.reason = reason
        await self._terminate()

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.client is not None:
            self.client.send(Shutdown())
            await self.client.close()
        await self._terminate()
        self.state = WorkerState.STOPPED
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _terminate(self) -> None:
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        try:
            await asyncio.wait_for(proc.wait(), self.settings.worker_stop_grace_s)
            return
        except TimeoutError:
            pass
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.settings.worker_stop_grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def _openblas_preload() -> str | None:
    """Debian's OpenBLAS makes MLX's CPU backend 20-30x faster (DESIGN.md §6)."""
    if not sys.platform.startswith("linux"):
        return None
    from glob import glob

    found = sorted(glob("/usr/lib/*/openblas-pthread/libopenblas.so.0"))
    return found[0] if found else None
