"""The worker process: socket, handshake, IO threads, engine loop, exit codes.

Threads:
- main thread = the engine thread: loads the model, accepts the gateway's
  connection, then loops `drain inbox -> EngineCore.step() -> outbox` (woken
  from idle by an Add, it first gathers the wave's other arrivals:
  `_gather_arrivals`). It is the only thread that touches MLX state.
- reader thread: blocking frame reads -> inbox (queue.Queue). Socket reads and
  msgpack decoding happen here, off the engine loop. It also confirms an
  Abort the moment it reads it, so a cancellation never waits for the step
  in flight (worker/request_ledger.py: every StepOutputs the engine sends
  passes the connection's ledger, which drops what follows a request's end).
- writer thread: outbox -> socket. The only thread that writes the socket.
- heartbeat thread: puts a Heartbeat on the outbox every `heartbeat_s`, so a
  long step cannot look like a dead worker; the step counter it carries lets the
  gateway tell a wedged engine from a busy one.
- malloc-trim thread: every few seconds while the engine steps, returns the C
  allocator's free pages to the system (`start_malloc_trimmer`).
- llg-compile pool: grammar compilation (worker/constraints.py).

The worker exits when the gateway's end of the socket closes, so no orphan
keeps the model's memory. SIGINT is ignored (a terminal's Ctrl-C reaches the
whole process group; the gateway orders the shutdown); SIGTERM stops at once.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol import exit_codes
from protocol.frames import PROTOCOL_VERSION, ProtocolError
from protocol.hidden_imports import hide_unused_frameworks
from protocol.messages import (
    Abort,
    Add,
    Dead,
    Failed,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    StepOutputs,
    Utility,
    UtilityResult,
)
from protocol.transport import FrameReader, write_message
from protocol.worker_config import (
    CRASH_SEED,
    FAULTS_ENV,
    LOAD_NO_MEMORY_ENV,
    TOKEN_ENV,
    WorkerConfig,
)
from worker.backend import PTX_CACHE_ENV
from worker.governor import kv_room_warning
from worker.request_ledger import RequestLedger

if TYPE_CHECKING:
    from worker import kernel_warm

log = logging.getLogger("mlxd.worker")
_STARTED = time.monotonic()  # this module's import: about the process's start

# How long the engine loop waits, idle, before it gives MLX's cached buffers back
# (EngineCore.release_idle_buffers): longer than a client's turn-around between
# requests, short enough that an idle worker holds them only briefly.
IDLE_RELEASE_S = 0.25

# How long after they start the warm-up waits for worker/kernel_warm.py's
# helpers (all of them were done in 16.9 s on a fresh H100, session 32); past
# it the warm-up compiles what is still missing itself, as it did before them.
KERNEL_WARM_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class _Closed:
    """Inbox sentinel: the connection ended (reason empty on clean EOF)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class _Wake:
    """Inbox item: a grammar finished compiling; the engine loop should step."""


_WAKE = _Wake()


@dataclass(frozen=True, slots=True)
class _RawBytes:
    """Outbox item written to the socket as is (test faults: a corrupt frame)."""

    data: bytes


class Connection:
    """One accepted gateway connection with its reader and writer threads."""

    def __init__(self, sock: socket.socket, config: WorkerConfig, inbox: queue.Queue[Any]) -> None:
        self.sock = sock
        self.inbox = inbox
        # Bounded: if the gateway stops reading, the engine blocks here rather
        # than buffering without limit.
        self.outbox: queue.Queue[Any] = queue.Queue(maxsize=1024)
        self.reader = FrameReader(sock, config.max_frame_bytes)
        self.closed = threading.Event()
        # Aborts are confirmed by the reader thread at once (worker/request_ledger.py).
        self.ledger = RequestLedger(config.epoch, self._put)
        self._threads = [
            threading.Thread(target=self._read_loop, name="ipc-reader", daemon=True),
            threading.Thread(target=self._write_loop, name="ipc-writer", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def send(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            self.ledger.send_outputs(msg)  # only outputs of requests not yet ended
        else:
            self._put(msg)

    def _put(self, msg: Any) -> None:
        # Blocks while the outbox is full (backpressure), but not past the
        # connection's end: the reader thread may be the one putting (an abort's
        # confirmation), and it must see its socket close.
        while not self.closed.is_set():
            with contextlib.suppress(queue.Full):
                self.outbox.put(msg, timeout=0.1)
                return

    def try_send(self, msg: Any) -> None:
        with contextlib.suppress(queue.Full):
            if not self.closed.is_set():
                self.outbox.put_nowait(msg)

    def _read_loop(self) -> None:
        reason = ""
        try:
            while True:
                msg = self.reader.read_message()
                if msg is None:
                    break
                if isinstance(msg, Add):
                    self.ledger.opened(msg.request_id)
                elif isinstance(msg, Abort):
                    # Confirmed now, carried out by the engine thread after its step.
                    self.ledger.abort(list(msg.request_ids))
                self.inbox.put(msg)
        except ProtocolError as e:
            reason = f"protocol error: {e}"
        except OSError as e:
            reason = f"socket error: {e}"
        self.closed.set()
        self.inbox.put(_Closed(reason))

    def _write_loop(self) -> None:
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            try:
                if isinstance(msg, _RawBytes):
                    self.sock.sendall(msg.data)
                else:
                    write_message(self.sock, msg)
            except OSError:
                self.closed.set()
                return

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(queue.Full):
            self.outbox.put_nowait(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _listen(path: str) -> socket.socket:
    p = Path(path)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(4)
    return srv


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None if unknown)."""
    import struct

    if hasattr(socket, "SO_PEERCRED"):  # Linux
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[1])
    if sys.platform == "darwin":
        # LOCAL_PEERCRED (SOL_LOCAL=0, option 1) returns a struct xucred:
        # u_int cr_version; uid_t cr_uid; ...
        creds = sock.getsockopt(0, 1, 4 + 4 + 2 + 16 * 4)
        return int(struct.unpack_from("=II", creds)[1])
    return None


def _accept(srv: socket.socket, timeout_s: float, parent: int) -> socket.socket | None:
    """Wait for the gateway; give up if it went away (we were re-parented)."""
    deadline = time.monotonic() + timeout_s
    srv.settimeout(0.5)
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            return None
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        uid = peer_uid(conn)
        if uid is not None and uid != os.getuid():
            # Belt and braces: the socket's directory is 0700 and the socket
            # 0600, but a peer of another user must never speak for the gateway.
            log.warning("refused a connection from uid %d", uid)
            conn.close()
            continue
        conn.settimeout(None)
        return conn
    return None


def _handshake(conn: socket.socket, config: WorkerConfig) -> Hello:
    """Read and check Hello; raise ProtocolError for anything else."""
    conn.settimeout(10.0)
    msg = FrameReader(conn, config.max_frame_bytes).read_message()
    conn.settimeout(None)
    if not isinstance(msg, Hello):
        raise ProtocolError(f"expected Hello, got {type(msg).__name__}")
    if msg.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.protocol_version} != {PROTOCOL_VERSION}")
    if msg.token != os.environ.get(TOKEN_ENV, ""):
        raise ProtocolError("handshake token mismatch")
    if msg.epoch != config.epoch:
        raise ProtocolError(f"epoch {msg.epoch} != {config.epoch}")
    return msg


# The longest an idle worker gathers a wave's arrivals, in quiet periods
# (`_gather_arrivals`): a stream of requests must not hold the first one back.
ARRIVAL_QUIET_CAP = 4

# How often the malloc-trim thread returns the C allocator's free pages while
# the engine is stepping (start_malloc_trimmer).
TRIM_INTERVAL_S = 5.0


def start_malloc_trimmer(
    core: Any, stop: threading.Event, interval_s: float = TRIM_INTERVAL_S
) -> None:
    """Every interval_s while the engine steps, give glibc's free pages back.

    The worker's RSS drifted by about 7 MiB per 1,000 requests while MLX's own
    memory and the count of Python objects stayed flat: pages the allocator
    keeps after the per-step temporaries (token lists, msgpack buffers, numpy
    masks) are freed, spread over its arenas. malloc_trim returns them; it runs
    here, off the engine thread (ctypes releases the GIL; a trim of a fragmented
    heap takes about 20 ms), and only when steps were taken since the last one.
    """
    from worker.runner import trim_malloc

    def run() -> None:
        last = -1
        while not stop.wait(interval_s):
            steps = core.counters.steps
            if steps != last:
                last = steps
                trim_malloc()

    threading.Thread(target=run, name="malloc-trim", daemon=True).start()


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=65536)
        self.faults = os.environ.get(FAULTS_ENV) == "1"
        self.link: Any = None  # worker/group.GroupLink when this worker is a group rank

    def serve(self) -> int:
        cfg = self.config
        parent = os.getppid()
        if cfg.group_size > 1 and os.environ.get("MLX_RANK", "0") != "0":
            return self._serve_as_follower()
        srv = _listen(cfg.socket)
        try:
            try:
                core = self._load()
            except Exception as e:  # any load failure is reported, not raised
                log.exception("model load failed")
                code = exit_codes.load_failure_code(e)  # out of memory: may fit later
                self._report_failure(srv, parent, f"model load failed: {e}", code)
                return code
            start_malloc_trimmer(core, threading.Event())  # runs for the process's life
            try:
                return self._serve_connections(srv, parent, core)
            finally:
                if core.step_trace is not None:
                    core.step_trace.close()
        finally:
            srv.close()
            with contextlib.suppress(OSError):
                os.unlink(cfg.socket)

    def _load(self) -> Any:
        # Imported here so `mlxd worker --help` and config errors need no MLX.
        from worker.backend import apply_env

        cache = Path(self.config.cache_dir) if self.config.cache_dir else None
        apply_env(self.config.cuda_graphs, cache)  # before MLX's first import in this process
        model_path = self._resolve_model()
        kernels = self._start_kernel_warm(model_path)
        try:
            return self._load_model(model_path, kernels)
        finally:
            if kernels is not None:
                kernels.stop()  # a load that failed leaves no helper running

    def _load_model(self, model_path: Path, kernels: kernel_warm.Helpers | None) -> Any:
        from worker.core import core_for, runner_for

        marker = os.environ.get(LOAD_NO_MEMORY_ENV, "") if self.faults else ""
        if marker and os.path.exists(marker):
            os.unlink(marker)  # test fault: this load fails, the next one may not
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        cfg = self.config
        group = None
        if cfg.group_size > 1:
            from worker.group import GroupLink, init_group

            group = init_group(cfg.group_backend)
            if group.size() != cfg.group_size:
                raise ValueError(f"joined a group of {group.size()}, expected {cfg.group_size}")
            self.link = GroupLink(group)
        if kernels is not None:
            kernels.merge()  # the pieces done by now serve the load's own first passes
        runner = runner_for(cfg, model_path, group)
        _set_switch_interval()
        if self.link is not None:
            self.link.stream = runner.generator.stream
        log.info(
            "model loaded: %s in %.2fs (%.2fs since the worker started)",
            model_path,
            runner.info.load_time_s,
            time.monotonic() - _STARTED,
        )
        gen = runner.generator
        log.info(
            "engine: fused step %s, decode rows %s, ragged decode attention %s, padded passes %s",
            *(
                "on" if x else "off"
                for x in (gen.fuse, gen.decode_rows, runner.ragged_decode, gen.pad_rows)
            ),
        )
        core = core_for(cfg, runner)
        if kernels is not None:
            log.info("kernel warm-up: %s", kernels.finish(KERNEL_WARM_WAIT_S))
        # A group's ranks must take identical steps: no clock-driven calibration.
        calibrate_s = 0.0 if cfg.group_size > 1 else cfg.pacing_calibration_s
        log.info("warm-up took %.2fs", core.warmup(calibrate_s=calibrate_s))
        if warning := kv_room_warning(
            core.governor.kv_capacity(), runner.info.kv_bytes_per_token, runner.info.context_length
        ):
            log.warning(warning)
        # Everything alive now (the imports, the model's modules) lives as long
        # as the process: out of the cyclic collector's sight, a full collection
        # walks only what serving allocates. On this CPU one walked about 80,000
        # objects in 26-28 ms, and one came every few seconds of serving, a
        # stall of every stream's step.
        gc.collect()
        gc.freeze()
        return core

    def _start_kernel_warm(self, model_path: Path) -> kernel_warm.Helpers | None:
        """worker/kernel_warm.py's helpers, on CUDA for a single worker whose
        kernel cache lacks them; None otherwise."""
        if not self.config.kernel_warm or self.config.group_size > 1:
            return None
        import mlx.core as mx

        if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
            return None
        from worker import kernel_warm

        cache = os.environ.get(PTX_CACHE_ENV)  # apply_env set it, or the user
        if not cache:
            return None
        try:
            return kernel_warm.start(Path(cache), kernel_warm.model_dtype(model_path))
        except OSError as e:  # a faster first start lost, not a reason to fail the load
            log.warning("kernel warm-up helpers not started: %s", e)
            return None

    def _resolve_model(self) -> Path:
        if self.config.model == "default":
            from worker.modelfiles.default_model import ensure_default_model

            cache = Path(self.config.cache_dir) if self.config.cache_dir else None
            return ensure_default_model(cache)
        path = Path(self.config.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        return path

    def _report_failure(self, srv: socket.socket, parent: int, reason: str, code: int) -> None:
        conn = _accept(srv, 10.0, parent)
        if conn is None:
            return
        with contextlib.suppress(OSError, ProtocolError), conn:
            _handshake(conn, self.config)
            write_message(conn, Failed(reason, code))

    def _ready_message(self, core: Any) -> Ready:
        from worker.modelfiles.default_model import blas_in_use
        from worker.runner import backend_name

        info = core.runner.info
        model_id = self.config.model_id or Path(info.path).name
        if not self.config.model_id and self.config.model == "default":
            from protocol.worker_config import DEFAULT_MODEL_NAME

            model_id = DEFAULT_MODEL_NAME
        return Ready(
            epoch=self.config.epoch,
            model_id=model_id,
            model_path=info.path,
            identity=info.identity,
            context_length=info.context_length,
            max_batch=self.config.max_batch,
            kv_bytes_per_token=info.kv_bytes_per_token,
            memory_budget=core.governor.kv_capacity(),
            backend=backend_name(),
            blas=blas_in_use(),
            eos_token_ids=list(info.eos_token_ids),
            pid=os.getpid(),
            load_time_s=info.load_time_s,
            vocab_size=info.vocab_size,
        )

    def _serve_connections(self, srv: socket.socket, parent: int, core: Any) -> int:
        # After a broken connection (bad frame), keep the model and wait for the
        # gateway to reconnect; a clean EOF means the gateway is gone: exit.
        while True:
            sock = _accept(srv, self.config.accept_timeout_s, parent)
            if sock is None:
                log.info("no gateway connected; exiting")
                return exit_codes.OK
            try:
                _handshake(sock, self.config)
            except (ProtocolError, OSError) as e:
                log.warning("handshake refused: %s", e)
                sock.close()
                continue
            conn = Connection(sock, self.config, self.inbox)
            conn.send(self._ready_message(core))
            conn.start()
            beat = threading.Thread(target=self._heartbeat, args=(conn, core), daemon=True)
            beat.start()
            reason = self._engine_loop(conn, core)
            conn.close()
            if self.link is not None:
                # The group cannot outlive its connection: tell every rank to stop.
                from worker.group import Round

                self.link.broadcast(Round(stop=True))
                return exit_codes.OK if not reason else exit_codes.PROTOCOL
            core.abort_all()
            core.step()  # retire the aborted requests; nobody is listening now
            if not reason:
                return exit_codes.OK
            log.warning("connection dropped: %s", reason)

    def _heartbeat(self, conn: Connection, core: Any) -> None:
        while not conn.closed.wait(self.config.heartbeat_s):
            conn.try_send(
                Heartbeat(
                    self.config.epoch,
                    core.counters.steps,
                    len(core.requests) - core.scheduler.waiting(),
                    core.scheduler.waiting(),
                    time.monotonic_ns(),
                    core.expected_step_s(),
                )
            )

    def _engine_loop(self, conn: Connection, core: Any) -> str:
        """Run until the connection ends; return why ("" for a clean EOF/shutdown)."""
        inbox = self.inbox
        forward: list[Any] = []  # commands for the other ranks of a group
        # A compile-pool thread wakes the loop when a grammar is ready; until then a
        # worker whose only requests are compiling waits rather than spins.
        core.on_compiled = lambda: inbox.put(_WAKE)
        while True:
            busy = core.needs_step() if self.link is None else core.has_work()
            if not busy:
                core.idle()  # before the wait: none of it on the next request
            try:
                item = inbox.get_nowait() if busy else inbox.get(timeout=IDLE_RELEASE_S)
            except queue.Empty:
                item = None
            added, reason = self._drain(item, conn, core, forward)
            if reason is None and added and not busy:
                reason = self._gather_arrivals(conn, core, forward)
            if reason is not None:
                return reason
            if not busy:
                core.release_idle_buffers(IDLE_RELEASE_S)  # not once a request came
            early = core.take_pending()
            if early is not None:
                conn.send(early)
            if self.link is not None:
                out = self._lead_round(core, forward)
                forward = []
            elif core.has_work():
                out = core.step()
            else:
                out = None
            if out is not None:
                conn.send(out)

    def _drain(
        self, item: Any, conn: Connection, core: Any, forward: list[Any]
    ) -> tuple[bool, str | None]:
        """Handle `item` and everything queued behind it: (an Add among them, why
        the loop must end or None)."""
        added = False
        while item is not None:
            if isinstance(item, _Closed):
                return added, item.reason
            if isinstance(item, Shutdown):
                conn.send(Dead("shutdown requested", exit_codes.OK))
                return added, ""
            if not isinstance(item, _Wake):
                added |= isinstance(item, Add)
                self._dispatch(item, conn, core, forward)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                item = None
        return added, None

    def _gather_arrivals(self, conn: Connection, core: Any, forward: list[Any]) -> str | None:
        """An idle worker that just received a request: before its first step, take
        what arrives until the inbox has been quiet for `arrival_quiet_s` (at most
        ARRIVAL_QUIET_CAP of them in all), so a wave the gateway submitted together
        but that reached the socket a fraction of a millisecond apart is admitted
        in one step (issue #12: on the H200 the wave's first Add otherwise started a
        prefill step alone and the rest waited a whole step for theirs). Only when
        idle: a busy worker admits what arrived during a step at the next one."""
        quiet = self.config.arrival_quiet_s
        if quiet <= 0:
            return None
        deadline = time.monotonic() + quiet * ARRIVAL_QUIET_CAP
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self.inbox.get(timeout=min(quiet, left))
            except queue.Empty:
                return None
            _, reason = self._drain(item, conn, core, forward)
            if reason is not None:
                return reason
        return None

    def _lead_round(self, core: Any, forward: list[Any]) -> Any:
        """Rank 0 of a group: plan, broadcast the round, then take the step everyone takes."""
        from worker.group import Round

        plan = core.plan_step() if core.wants_step() else None
        self.link.broadcast(Round(False, forward, plan))
        return core.step(plan, planned=True)

    def _serve_as_follower(self) -> int:
        """Ranks 1..N-1: no socket; apply rank 0's rounds until told to stop."""
        core = self._load()
        link = self.link
        log.info("rank %d of %d following rank 0", link.rank, link.size)
        while True:
            rnd = link.broadcast(None)
            if rnd.stop:
                return exit_codes.OK
            core.release_idle_buffers(IDLE_RELEASE_S)  # as rank 0: only once idle that long
            for cmd in rnd.commands:
                if isinstance(cmd, Add):
                    core.add(cmd)
                else:
                    core.abort(list(cmd.request_ids))
            if rnd.plan is not None:
                core.follow_plan(rnd.plan)
            core.step(rnd.plan, planned=True)

    def _dispatch(self, msg: Any, conn: Connection, core: Any, forward: list[Any]) -> None:
        # `forward` is emptied by each group round; a lone worker has none, so it
        # collects nothing (it kept every Add and Abort for the process's life:
        # the worker memory drift of issue 13, finding 11).
        group = self.link is not None
        if isinstance(msg, Add):
            if self.faults and msg.sampling.seed == CRASH_SEED:
                os._exit(exit_codes.CRASH)  # test-only poison request
            core.add(msg)
            if group and msg.request_id in core.requests:  # followers see what rank 0 accepted
                forward.append(msg)
        elif isinstance(msg, Abort):
            core.abort(list(msg.request_ids))
            if group:
                forward.append(msg)
        elif isinstance(msg, Utility):
            conn.send(self._utility(msg, core, conn))
        else:
            log.warning("ignoring unexpected %s from the gateway", type(msg).__name__)

    def _utility(self, msg: Utility, core: Any, conn: Connection) -> UtilityResult:
        try:
            if msg.method == "stats":
                return UtilityResult(msg.call_id, True, {**core.stats(), "python_heap": _heap()})
            if msg.method == "step_timeline":
                since = float(msg.args.get("since", 0.0))
                return UtilityResult(msg.call_id, True, {"steps": core.step_timeline(since)})
            if msg.method == "fault" and self.faults:
                return self._fault(msg, conn, core)
            if msg.method == "tracemalloc" and self.faults:
                return UtilityResult(msg.call_id, True, _tracemalloc_top(msg.args))
            return UtilityResult(msg.call_id, False, error=f"unknown method {msg.method!r}")
        except Exception as e:  # a bad utility call must not kill the engine
            log.exception("utility %s failed", msg.method)
            return UtilityResult(msg.call_id, False, error=str(e))

    def _fault(self, msg: Utility, conn: Connection, core: Any) -> UtilityResult:
        kind = msg.args.get("kind")
        if kind == "wedge":
            # Test-only: block the engine thread as a hung kernel would.
            time.sleep(float(msg.args.get("seconds", 3600)))
        elif kind == "crash":
            os._exit(exit_codes.CRASH)
        elif kind == "step_no_memory":
            # Test-only: a coming step runs, then fails as a device that ran out
            # of memory would, its tokens unreported (EngineCore._recover).
            fail_next_step(core.runner, int(msg.args.get("steps") or 1))
        elif kind == "corrupt":
            # Test-only: a frame the gateway cannot decode, from a worker that
            # stays alive, so the gateway must drop the connection and replace it.
            conn.send(_RawBytes(b"MLXD\xff" + bytes(7)))
        return UtilityResult(msg.call_id, True)


def fail_next_step(runner: Any, steps: int = 1) -> None:
    """Test-only: the runner's `steps`-th step from now runs whole, then raises the
    error CUDA's allocator gives when the device is full; the others are the
    runner's own."""
    real = runner.step

    def failing() -> Any:
        nonlocal steps
        steps -= 1
        if steps > 0:
            return real()
        del runner.step  # the class's step again
        real()
        raise RuntimeError(
            "[test fault] cudaMallocAsync(&data, size, stream) failed: out of memory"
        )

    runner.step = failing


def _set_switch_interval() -> None:
    """The backend's GIL switch interval for this process (worker/backend.py says why)."""
    from worker.backend import profile
    from worker.runner import backend_name

    interval = profile(backend_name()).switch_interval_s
    if interval is not None:
        sys.setswitchinterval(interval)


def _heap() -> dict[str, Any]:
    """The cyclic collector's state: the objects frozen after the warm-up, and
    its runs per generation (a full one walks only what serving allocated)."""
    return {
        "frozen": gc.get_freeze_count(),
        "collections": [g["collections"] for g in gc.get_stats()],
    }


def _tracemalloc_top(args: dict[str, Any]) -> dict[str, Any]:
    """Test-only (FAULTS_ENV): start tracemalloc, or the top growth since its start.

    bench/worker_soak.py calls it to see where a worker's Python heap grows.
    """
    import tracemalloc

    if not tracemalloc.is_tracing():
        tracemalloc.start(int(args.get("frames", 1)))
        _TRACE["base"] = tracemalloc.take_snapshot()
        return {"started": True}
    gc.collect()
    snap = tracemalloc.take_snapshot()
    diff = snap.compare_to(_TRACE["base"], "lineno")[: int(args.get("top", 15))]
    return {
        "traced_bytes": tracemalloc.get_traced_memory()[0],
        "objects": len(gc.get_objects()),
        "top": [str(d) for d in diff],
    }


_TRACE: dict[str, Any] = {}


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, like the gateway's structlog output."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "event": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def _exit_with_parent() -> None:
    """Never outlive the gateway, even while loading a model (no socket yet).

    Linux delivers SIGKILL on the parent's death (PR_SET_PDEATHSIG); elsewhere
    a watcher thread notices that we were re-parented.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(exit_codes.OK)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(exit_codes.OK)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    hide_unused_frameworks()
    _configure_logging()
    try:
        config = WorkerConfig.from_argv(argv)
    except SystemExit:
        return exit_codes.BAD_CONFIG
    except ValueError as e:
        print(f"mlxd worker: invalid configuration: {e}", file=sys.stderr)
        return exit_codes.BAD_CONFIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    from worker.runner import fix_mmap_threshold

    fix_mmap_threshold()  # before the model's buffers exist (worker/runner.py)
    worker = Worker(config)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(exit_codes.OK))
    try:
        return worker.serve()
    except Exception:
        log.exception("worker crashed")
        return exit_codes.CRASH
