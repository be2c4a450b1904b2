"""Starts, watches and restarts the worker process.

State machine of one served model's worker:

    STARTING --(Ready)--> READY --(exit | lost | wedged)--> RESTARTING --> STARTING ...
        |                   |                                   |
        |                   +--(gateway SIGTERM)--> DRAINING    +--(budget spent)--> FAILED
        +--(Failed, or exit code MODEL_LOAD / BAD_CONFIG)-------------------------> FAILED
        +--(Failed with NO_MEMORY: out of memory while loading)--> RESTARTING, as a crash
    FAILED (budget spent) --(cool-down: failed_retry_s, doubling)--> STARTING ...
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
  Crashes that a poison request explains do not count (gateway/workers/
  crash_ledger.py). A model FAILED by its crash budget is started again after
  a cool-down that doubles on each consecutive failure (`failed_retry_s` up to
  `failed_retry_max_s`; 0: never), so a service under launchd or systemd heals
  without a restart of the gateway; a failure no restart can help (model load,
  bad configuration) stays FAILED.
- Wedge: the worker's heartbeat thread keeps beating during a long step, and
  each beat carries the step counter and the longest step the worker expects.
  With requests in flight and no step progress within the watchdog window
  (at least 3x that estimate), the worker is killed (SIGTERM, grace, SIGKILL)
  and restarted. A missing heartbeat means the process is gone or frozen.
- The gateway's own stalls are not the worker's: when the watch loop wakes
  more than `LOOP_LATE_S` past its tick (the gateway was descheduled, stopped
  or swapping), the worker's beats may sit unread in the socket, so both
  verdicts count from that wake-up. Before, a gateway stopped for 8 s killed
  a healthy worker on waking ("no heartbeat for 8.1 s").

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.config import Settings
from gateway.workers.client import WorkerClient, WorkerFailed, WorkerUnavailable
from gateway.workers.launch import first_exit, launch_env, spawn_group
from gateway.workers.restart import RestartBudget, RestartPolicy
from protocol import exit_codes
from protocol.frames import PROTOCOL_VERSION
from protocol.messages import Hello, Shutdown

log = logging.getLogger("mlxd.gateway.supervisor")


# The watch loop woke this much past its tick: the gateway stalled, not the worker.
LOOP_LATE_S = 1.0


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


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
        self._budget = RestartBudget(self.policy)
        self.retry_at: float | None = None  # FAILED: when the next start is attempted
        # When the watch loop last woke from a stall of the gateway's own (module doc).
        self._resumed_at = 0.0
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
        while not self._stopping.is_set():
            code, reason = await self._run_one()
            if self._stopping.is_set():
                return
            self.last_exit = reason
            if code in exit_codes.NOT_RESTARTABLE:
                self._fail(reason)
                return
            now = time.monotonic()
            backoff = self._budget.crashed(now, self.ready_at, self.epoch)
            if backoff is None:
                self._fail(
                    f"{self._budget.counted} crashes within "
                    f"{self.policy.crash_window_s:.0f}s; last: {reason}"
                )
                if not await self._cool_down():
                    return
                continue
            delay = backoff * random.uniform(0.8, 1.2)  # jitter: no lock-step restarts
            self.restarts += 1
            self._set_state(WorkerState.RESTARTING, reason)
            log.warning("restarting worker in %.2fs (restart %d): %s", delay, self.restarts, reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _cool_down(self) -> bool:
        """FAILED by the crash budget: wait out the cool-down; False: stay FAILED."""
        delay = self._budget.cool_down_s()
        if delay is None:
            return False
        self.retry_at = time.monotonic() + delay
        log.warning(
            "model FAILED; trying again in %.1fs (failure %d)", delay, self._budget.failures
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)
        self.retry_at = None
        if self._stopping.is_set():
            return False
        self._budget.restart_after_cool_down()
        self.settled.clear()  # startup is under way again until READY or FAILED
        return True

    def retry_in_s(self) -> float | None:
        """Seconds until a FAILED model is started again (None: not scheduled)."""
        return None if self.retry_at is None else max(0.0, self.retry_at - time.monotonic())

    @property
    def poisoned_requests(self) -> int:
        """Requests dropped so far for crashing the worker twice (the crash ledger)."""
        return self._budget.ledger.poisoned

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
        exited = asyncio.ensure_future(first_exit(self.processes))
        try:
            try:
                self.client = await self._connect(
                    Hello(PROTOCOL_VERSION, self.epoch, token), exited
                )
            except WorkerFailed as e:
                # Failed(...) from the worker: the model did not load (for good,
                # or for want of memory now: NO_MEMORY, restarted as a crash).
                await self._terminate()
                return e.exit_code, str(e)
            except WorkerUnavailable as e:
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
        config = self.settings.worker_config(socket=self.socket_path, epoch=self.epoch)
        env = launch_env(self._extra_env, token, test_faults=self.settings.test_faults)
        return await spawn_group(config, env, self._dir)

    async def _connect(self, hello: Hello, exited: asyncio.Future[int]) -> WorkerClient:
        """Connect once the worker listens; give up if it exits first."""
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        while True:
            if exited.done():
                code = exited.result()
                raise WorkerFailed(f"worker {exit_codes.describe(code)}", code)
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
                tick = self._tick()
                asked = time.monotonic()
                done, _ = await asyncio.wait(  # type: ignore[type-var]
                    {exited, lost, stopping},
                    timeout=tick,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if time.monotonic() - asked > tick + LOOP_LATE_S:
                    self._resumed_at = time.monotonic()
                if stopping in done:
                    return "stopped"
                if exited in done:
                    return f"worker {exit_codes.describe(exited.result())}"
                if lost in done:
                    return f"worker connection lost: {client.lost_reason}"
                problem = self.health()
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

    def health(self) -> str:
        """Why the connected worker is unhealthy, or "" when it is healthy (or none is connected).

        Unhealthy: no heartbeat within the heartbeat timeout (the process is gone
        or frozen), or requests in flight and no engine step progress within the
        watchdog window (wedged). The watchdog kills and restarts a worker for
        either; /ready reports the same verdict (gateway/http/operations.py).
        """
        client = self.client
        if client is None:
            return ""
        now = time.monotonic()
        beat_age = now - max(client.last_heartbeat_at, self._resumed_at)
        if beat_age > self.policy.heartbeat_timeout_s:
            return f"no heartbeat from the worker for {beat_age:.1f} s"
        stalled = min(client.stalled_for(), now - self._resumed_at)
        if stalled > self.watchdog_window():
            return f"worker wedged: no engine step progress for {stalled:.1f} s with work in flight"
        return ""

    def watchdog_window(self) -> float:
        """No-progress time after which a worker with work counts as wedged."""
        expected = self.client.expected_step_s if self.client is not None else 0.0
        return max(self.policy.watchdog_s, 3.0 * expected)

    # -- state ------------------------------------------------------------------

    def _on_ready(self) -> None:
        assert self.client is not None
        self.client.retire_hooks = self.retire_hooks
        self.client.lost_hooks = [self._budget.ledger.worker_lost]
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
