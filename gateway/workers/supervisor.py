"""Starts, watches and restarts the worker process.

State machine of one served model's worker:

    STARTING --(Ready)--> READY --(exit | lost | wedged)--> RESTARTING --> STARTING ...
        |                   |                                   |
        |                   +--(gateway SIGTERM)--> DRAINING    +--(budget spent)--> FAILED
        +--(Failed, or exit code MODEL_LOAD / BAD_CONFIG)-------------------------> FAILED
    any --(stop)--> STOPPED

- Every worker is a fresh interpreter (`python -m worker`, spawn semantics),
  on a Unix socket inside a private directory (mkdtemp: 0700; the worker
  creates the socket 0600). A random per-start token in the worker's
  environment authenticates the handshake, and each start gets a new epoch so
  frames of a dead worker are dropped.
- Crash: the process exits or the connection breaks. SIGKILL is reported as a
  likely out-of-memory kill. Restarts back off exponentially with jitter
  (reset after a stable period); a crash budget (N crashes within M seconds)
  ends in FAILED, as does any exit code that says a restart cannot help.
- Wedge: the worker's heartbeat thread keeps beating during a long step, and
  each beat carries the step counter and the longest step the worker expects.
  With requests in flight and no step progress within the watchdog window
  (at least 3x that estimate), the worker is killed (SIGTERM, grace, SIGKILL)
  and restarted. A missing heartbeat means the process is gone or frozen.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.config import Settings
from gateway.workers.client import WorkerClient, WorkerUnavailable
from protocol import exit_codes
from protocol.frames import PROTOCOL_VERSION
from protocol.messages import Hello, Shutdown
from protocol.worker_config import FAULTS_ENV, TOKEN_ENV, WorkerConfig, openblas_preload_path

log = logging.getLogger("mlxd.gateway.supervisor")


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # uptime after which the backoff starts over
    crash_budget: int = 5  # crashes within crash_window_s that end in FAILED
    crash_window_s: float = 600.0
    watchdog_s: float = 30.0  # no step progress with work in flight for this long: wedged
    heartbeat_timeout_s: float = 10.0

    @classmethod
    def from_settings(cls, s: Settings) -> RestartPolicy:
        return cls(
            backoff_initial_s=s.restart_backoff_initial_s,
            backoff_max_s=s.restart_backoff_max_s,
            stable_s=s.restart_stable_s,
            crash_budget=s.restart_crash_budget,
            crash_window_s=s.restart_crash_window_s,
            watchdog_s=s.watchdog_s,
            heartbeat_timeout_s=max(s.heartbeat_timeout_s, 4 * s.worker_heartbeat_s),
        )


class Supervisor:
    def __init__(self, settings: Settings, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.policy = RestartPolicy.from_settings(settings)
        self.state = WorkerState.STARTING
        self.reason = ""
        self.client: WorkerClient | None = None
        self.processes: list[asyncio.subprocess.Process] = []  # one per rank; rank 0 first
        self.epoch = 0
        self.restarts = 0
        self.last_exit = ""
        self.started_at = time.monotonic()  # of the current worker process
        self.ready_at: float | None = None
        self.first_ready_at: float | None = None
        self.ready_event = asyncio.Event()
        self.settled = asyncio.Event()  # set on READY or FAILED: startup is over
        # Set (and replaced) on every state change: waiters see FAILED at once.
        self.state_changed = asyncio.Event()
        self._extra_env = extra_env or {}
        self._dir = Path(tempfile.mkdtemp(prefix="mlxd-"))  # mkdtemp makes it 0700
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._crashes: deque[float] = deque()
        # Handed to every WorkerClient (see WorkerClient.retire_hooks).
        self.retire_hooks: list[Callable[[str, str | None, float], None]] = []

    # -- public ---------------------------------------------------------------

    @property
    def socket_path(self) -> str:
        return str(self._dir / f"worker-{self.epoch}.sock")

    @property
    def process(self) -> asyncio.subprocess.Process | None:
        """Rank 0: the worker the gateway talks to."""
        return self.processes[0] if self.processes else None

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.ready_at if self.ready_at is not None else 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def drain(self) -> None:
        """The gateway is shutting down: readiness goes false, requests continue."""
        if self.state == WorkerState.READY:
            self._set_state(WorkerState.DRAINING, "gateway shutting down")

    async def stop(self) -> None:
        self._stopping.set()
        if self.client is not None and not self.client.closed:
            self.client.send(Shutdown())
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._terminate()
        if self.client is not None:
            await self.client.close()
        self._set_state(WorkerState.STOPPED, "stopped")
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- the run loop -----------------------------------------------------------

    async def _run(self) -> None:
        backoff = self.policy.backoff_initial_s
        while not self._stopping.is_set():
            code, reason = await self._run_one()
            if self._stopping.is_set():
                return
            self.last_exit = reason
            if code in exit_codes.NOT_RESTARTABLE:
                self._fail(reason)
                return
            now = time.monotonic()
            self._crashes.append(now)
            while self._crashes and now - self._crashes[0] > self.policy.crash_window_s:
                self._crashes.popleft()
            if len(self._crashes) >= self.policy.crash_budget:
                self._fail(
                    f"{len(self._crashes)} crashes within "
                    f"{self.policy.crash_window_s:.0f}s; last: {reason}"
                )
                return
            if self.ready_at is not None and now - self.ready_at > self.policy.stable_s:
                backoff = self.policy.backoff_initial_s
            delay = backoff * random.uniform(0.8, 1.2)  # jitter: no lock-step restarts
            backoff = min(backoff * 2, self.policy.backoff_max_s)
            self.restarts += 1
            self._set_state(WorkerState.RESTARTING, reason)
            log.warning("restarting worker in %.2fs (restart %d): %s", delay, self.restarts, reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _run_one(self) -> tuple[int | None, str]:
        """Start one worker and watch it until it is gone; returns (exit code, reason)."""
        self.epoch += 1
        token = secrets.token_hex(16)
        if self.state != WorkerState.RESTARTING:
            self._set_state(WorkerState.STARTING, "")
        try:
            self.processes = await self._spawn(token)
        except OSError as e:
            return exit_codes.BAD_CONFIG, f"cannot start the worker: {e}"
        self.started_at = time.monotonic()
        # Any rank's exit ends the whole group: a group is restarted together.
        exited = asyncio.ensure_future(_first_exit(self.processes))
        try:
            try:
                self.client = await self._connect(
                    Hello(PROTOCOL_VERSION, self.epoch, token), exited
                )
            except WorkerUnavailable as e:
                # Failed(...) from the worker: the model cannot load.
                await self._terminate()
                return exit_codes.MODEL_LOAD, str(e)
            except (OSError, TimeoutError, Exception) as e:
                await self._terminate()
                code = self.processes[0].returncode
                why = exit_codes.describe(code) if code is not None else (str(e) or repr(e))
                return code, f"worker failed during startup: {why}"
            self._on_ready()
            reason = await self._watch(exited)
            self.ready_event.clear()
            if self.client is not None and not self.client.closed:
                await self.client.close(reason)
            await self._terminate()
            code = self.processes[0].returncode
            if code is not None and code < 0 and "exited" not in reason:
                reason = f"{reason} ({exit_codes.describe(code)})"
            return code, reason
        finally:
            if not exited.done():
                exited.cancel()

    async def _spawn(self, token: str) -> list[asyncio.subprocess.Process]:
        s = self.settings
        size = getattr(s, "group_size", 1)
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
            pacing_factor=s.pacing_factor,
            pacing_calibration_s=s.pacing_calibration_s,
            cuda_graphs=s.cuda_graphs,
            chunk_buckets=s.chunk_buckets,
            memory_budget_bytes=s.memory_budget_bytes,
            kv_budget_bytes=s.kv_budget_bytes,
            prefix_cache_bytes=s.prefix_cache_bytes,
            heartbeat_s=s.worker_heartbeat_s,
            group_size=size,
            group_backend=getattr(s, "group_backend", "ring"),
        )
        env = dict(os.environ, **self._extra_env)
        env[TOKEN_ENV] = token
        if getattr(s, "test_faults", False):
            env[FAULTS_ENV] = "1"
        env.setdefault("PYTHONUNBUFFERED", "1")
        preload = _openblas_preload()
        if preload and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = preload
        procs = []
        for rank, rank_env in enumerate(self._group_env(size)):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "worker", *config.to_argv(), env={**env, **rank_env}
            )
            procs.append(proc)
            log.info(
                "worker started: pid %d, epoch %d, rank %d of %d", proc.pid, self.epoch, rank, size
            )
        return procs

    def _group_env(self, size: int) -> list[dict[str, str]]:
        """Each rank's MLX distributed environment (one empty dict for a single worker)."""
        if size == 1:
            return [{}]
        ports = _free_ports(size)
        backend = getattr(self.settings, "group_backend", "ring")
        common = {"MLX_WORLD_SIZE": str(size)}
        if backend == "ring":
            hostfile = self._dir / f"hosts-{self.epoch}.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
            common["MLX_HOSTFILE"] = str(hostfile)
        else:  # nccl: rank 0 hosts the rendezvous; one GPU per rank
            common.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(ports[0]), NCCL_NVLS_ENABLE="0")
        return [
            {
                **common,
                "MLX_RANK": str(r),
                **({"CUDA_VISIBLE_DEVICES": str(r)} if backend == "nccl" else {}),
            }
            for r in range(size)
        ]

    async def _connect(self, hello: Hello, exited: asyncio.Future[int]) -> WorkerClient:
        """Connect once the worker listens; give up if it exits first."""
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        while True:
            if exited.done():
                raise WorkerUnavailable(f"worker {exit_codes.describe(exited.result())}")
            if Path(self.socket_path).exists():
                connect = asyncio.ensure_future(
                    WorkerClient.connect(self.socket_path, hello, deadline - time.monotonic())
                )
                done, _ = await asyncio.wait(
                    {connect, exited},  # type: ignore[type-var]
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if connect in done:
                    return connect.result()
                connect.cancel()
                continue
            if time.monotonic() > deadline:
                raise TimeoutError("worker did not start in time")
            # The socket appears as soon as the worker runs; poll for it briefly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), 0.05)

    async def _watch(self, exited: asyncio.Future[int]) -> str:
        """Wait until the worker is gone, lost or wedged; return why."""
        client = self.client
        assert client is not None
        lost = asyncio.ensure_future(client.lost.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while True:
                done, _ = await asyncio.wait(  # type: ignore[type-var]
                    {exited, lost, stopping},
                    timeout=self._tick(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if stopping in done:
                    return "stopped"
                if exited in done:
                    return f"worker {exit_codes.describe(exited.result())}"
                if lost in done:
                    return f"worker connection lost: {client.lost_reason}"
                problem = self._health_problem(client)
                if problem:
                    log.error(
                        "%s; killing worker pid %d",
                        problem,
                        self.process.pid if self.process else -1,
                    )
                    return problem
        finally:
            lost.cancel()
            stopping.cancel()

    def _tick(self) -> float:
        return max(0.05, min(1.0, self.policy.watchdog_s / 4))

    def _health_problem(self, client: WorkerClient) -> str:
        now = time.monotonic()
        if now - client.last_heartbeat_at > self.policy.heartbeat_timeout_s:
            return f"no heartbeat for {now - client.last_heartbeat_at:.1f}s"
        window = self.watchdog_window(client)
        stalled = client.stalled_for()
        if stalled > window:
            return f"worker wedged: no step progress for {stalled:.1f}s with work in flight"
        return ""

    def watchdog_window(self, client: WorkerClient | None = None) -> float:
        """No-progress time after which a worker with work counts as wedged."""
        client = client or self.client
        expected = client.expected_step_s if client is not None else 0.0
        return max(self.policy.watchdog_s, 3.0 * expected)

    # -- state ------------------------------------------------------------------

    def _on_ready(self) -> None:
        assert self.client is not None
        self.client.retire_hooks = self.retire_hooks
        r = self.client.ready
        self.ready_at = time.monotonic()
        if self.first_ready_at is None:
            self.first_ready_at = self.ready_at
        self._set_state(WorkerState.READY, "")
        log.info(
            "worker ready: model %s (%s) backend=%s blas=%s load=%.2fs context=%d epoch=%d",
            r.model_id,
            r.identity,
            r.backend,
            r.blas,
            r.load_time_s,
            r.context_length,
            self.epoch,
        )
        self.ready_event.set()
        self.settled.set()

    def _fail(self, reason: str) -> None:
        log.error("worker failed for good: %s", reason)
        self._set_state(WorkerState.FAILED, reason)
        self.ready_event.clear()
        self.settled.set()

    def _set_state(self, state: WorkerState, reason: str) -> None:
        self.state = state
        self.reason = reason
        self.state_changed.set()
        self.state_changed = asyncio.Event()

    async def _terminate(self) -> None:
        """Every rank: SIGTERM, a grace period, then SIGKILL."""
        await asyncio.gather(*(self._terminate_one(p) for p in self.processes))

    async def _terminate_one(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        grace = self.settings.worker_stop_grace_s
        if self._stopping.is_set():
            # A Shutdown was sent: give the worker the grace to exit by itself.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
                return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _first_exit(procs: list[asyncio.subprocess.Process]) -> int:
    waits = [asyncio.ensure_future(p.wait()) for p in procs]
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return next(iter(done)).result()
    finally:
        for w in waits:
            w.cancel()


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _openblas_preload() -> str | None:
    """Debian's OpenBLAS makes MLX's CPU backend 20-30x faster (DESIGN.md §6)."""
    if not sys.platform.startswith("linux"):
        return None
    return openblas_preload_path()
