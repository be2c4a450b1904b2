"""One multiplexed IPC connection to a worker, and per-request output collectors.

Threading: everything here runs on the gateway's event loop. A reader task
decodes one StepOutputs frame per engine step and fans its outputs out to the
`RequestStream` of each request. A stream merges the deltas that arrive while
its consumer is busy (tokens are appended to one list and an event is set), so
a slow HTTP client costs memory bounded by its max_tokens, never one queue
item per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.frames import DEFAULT_MAX_FRAME_BYTES, HEADER, ProtocolError
from protocol.messages import (
    Abort,
    Add,
    Dead,
    Failed,
    Heartbeat,
    Hello,
    Ready,
    StepOutputs,
    Utility,
    UtilityResult,
    encode_message,
)
from protocol.transport import read_message_async

log = logging.getLogger("mlxd.gateway.worker_client")


class WorkerUnavailable(Exception):
    """The worker connection is gone (crash, restart, shutdown)."""


class WorkerFailed(WorkerUnavailable):
    """The worker said at its handshake that it cannot serve (Failed): why, and
    the exit code it leaves with (protocol/exit_codes.py)."""

    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


class MessageTooLarge(ValueError):
    """An encoded message is over the worker's frame limit: it was not sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"the request encodes to {size} bytes for the worker, over its limit of {limit} "
            "bytes (a smaller prompt, schema or grammar fits)"
        )
        self.size, self.limit = size, limit


@dataclass(slots=True)
class Delta:
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[list[float]]] | None
    finish_reason: str | None
    error: str
    worker_lost: bool = False  # the error is the worker's death, not the request's fault


@dataclass(slots=True)
class RequestStream:
    """Collects one request's outputs until its terminal event."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""
    first_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens the worker reused from its prefix cache
    prefill_start_at: float | None = None  # gateway clock, from the worker's durations
    worker_lost: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def push(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        error: str = "",
        logprobs: list[float] | None = None,
        top_logprobs: list[list[list[float]]] | None = None,
    ) -> None:
        if self.finish_reason is not None:
            return  # exactly one terminal event; later ones are ignored
        if token_ids:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.tokens.extend(token_ids)
            if logprobs:
                self.logprobs.extend(logprobs)
            if top_logprobs:
                self.top_logprobs.extend(top_logprobs)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.error = error
        self.event.set()

    async def next(self) -> Delta:
        """Wait for new output; returns everything that arrived since the last call."""
        await self.event.wait()
        self.event.clear()
        delta = Delta(
            self.tokens,
            self.logprobs or None,
            self.top_logprobs or None,
            self.finish_reason,
            self.error,
            self.worker_lost,
        )
        self.tokens, self.logprobs, self.top_logprobs = [], [], []
        return delta


class WorkerClient:
    """The gateway's end of one worker connection (after the handshake)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ready: Ready,
    ) -> None:
        self.ready = ready
        self.epoch = ready.epoch
        self._reader = reader
        self._writer = writer
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_ids = itertools.count(1)
        self.closed = False
        self.lost = asyncio.Event()  # set once when the connection ends for any reason
        self.lost_reason = ""
        self.last_heartbeat: Heartbeat | None = None
        self.last_heartbeat_at = time.monotonic()
        self.last_step = 0
        self.last_step_progress_at = time.monotonic()
        self.busy_since = time.monotonic()  # when the in-flight count last left zero
        # Called with (request id, finish reason, time) for every request the
        # worker retires, aborted ones included (cancellation-to-retirement).
        self.retire_hooks: list[Callable[[str, str | None, float], None]] = []
        # Called with (epoch, ids of the requests in flight) when the connection
        # ends, before `lost` is set (gateway/workers/crash_ledger.py).
        self.lost_hooks: list[Callable[[int, list[str]], None]] = []
        # What the worker's frame reader accepts (protocol/worker_config.py's
        # max_frame_bytes: the supervisor leaves it at its default).
        self.max_frame_bytes = DEFAULT_MAX_FRAME_BYTES
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(
        cls,
        socket_path: str,
        hello: Hello,
        timeout_s: float,
    ) -> WorkerClient:
        """Connect, send Hello, wait for Ready; raises WorkerUnavailable on Failed."""
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=1 << 20)
        try:
            writer.write(encode_message(hello))
            await writer.drain()
            msg = await asyncio.wait_for(read_message_async(reader), timeout_s)
        except BaseException:
            writer.close()
            raise
        if isinstance(msg, Failed):
            writer.close()
            raise WorkerFailed(msg.reason, msg.exit_code)
        if not isinstance(msg, Ready):
            writer.close()
            raise ProtocolError(f"expected Ready, got {type(msg).__name__}")
        return cls(reader, writer, msg)

    # -- commands -----------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._streams)

    @property
    def expected_step_s(self) -> float:
        """The longest step the worker says it may legitimately take."""
        hb = self.last_heartbeat
        return hb.max_step_s if hb is not None else 0.0

    def stalled_for(self) -> float:
        """Seconds without step progress while requests are in flight (0 when idle)."""
        if not self._streams:
            return 0.0
        return time.monotonic() - max(self.last_step_progress_at, self.busy_since)

    def add(self, msg: Add) -> RequestStream:
        if self.closed:
            raise WorkerUnavailable("worker connection closed")
        # Encode first: a message that cannot be encoded (ProtocolError) must not
        # leave a stream behind, which would count as work in flight forever.
        frame = encode_message(msg)
        if len(frame) - HEADER.size > self.max_frame_bytes:
            # The worker would drop the connection (and every other request on it).
            raise MessageTooLarge(len(frame) - HEADER.size, self.max_frame_bytes)
        stream = RequestStream(msg.request_id)
        if not self._streams:
            self.busy_since = time.monotonic()
        self._streams[msg.request_id] = stream
        self._writer.write(frame)
        return stream

    def abort(self, request_id: str) -> None:
        """Idempotent: aborting a finished or unknown request does nothing."""
        if self._streams.pop(request_id, None) is not None and not self.closed:
            self._writer.write(encode_message(Abort([request_id])))

    async def call(
        self, method: str, args: dict[str, Any] | None = None, timeout_s: float = 10.0
    ) -> dict[str, Any]:
        if self.closed:
            raise WorkerUnavailable("worker connection closed")
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._writer.write(encode_message(Utility(call_id, method, args or {})))
        try:
            result = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)
        if not result.ok:
            raise RuntimeError(result.error)
        return dict(result.result)

    def send(self, msg: Any) -> None:
        if not self.closed:
            self._writer.write(encode_message(msg))

    async def close(self, reason: str = "closed by the gateway") -> None:
        if not self.closed:
            self._lost(reason)
        self._task.cancel()
        self._writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()

    # -- the read loop --------------------------------------------------------

    async def _read_loop(self) -> None:
        reason = "worker closed the connection"
        try:
            while True:
                msg = await read_message_async(self._reader)
                if msg is None:
                    break
                if isinstance(msg, StepOutputs | Heartbeat) and msg.epoch != self.epoch:
                    continue  # a frame from an epoch we already declared dead
                if isinstance(msg, StepOutputs):
                    self._on_step(msg)
                elif isinstance(msg, Heartbeat):
                    self.last_heartbeat = msg
                    self.last_heartbeat_at = time.monotonic()
                    self._note_step(msg.step)
                elif isinstance(msg, UtilityResult):
                    fut = self._calls.get(msg.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, Dead):
                    reason = f"worker exiting: {msg.reason}"
                    break
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from the worker")
        except ProtocolError as e:
            reason = f"protocol error: {e}"
            log.error("dropping worker connection: %s", reason)
        except (OSError, ConnectionError) as e:
            reason = f"connection error: {e}"
        except asyncio.CancelledError:
            return
        self._lost(reason)

    def _note_step(self, step: int) -> None:
        if step != self.last_step:
            self.last_step = step
            self.last_step_progress_at = time.monotonic()

    def _on_step(self, msg: StepOutputs) -> None:
        self._note_step(msg.step)
        streams = self._streams
        for out in msg.outputs:
            if out.finish_reason is not None and self.retire_hooks:
                now = time.monotonic()
                for hook in self.retire_hooks:
                    hook(out.request_id, out.finish_reason, now)
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted or already finished here
            if out.cached_tokens:
                stream.cached_tokens = out.cached_tokens
            if out.prefill_s and stream.prefill_start_at is None:
                stream.prefill_start_at = time.monotonic() - out.prefill_s
            stream.push(out.token_ids, out.finish_reason, out.error, out.logprobs, out.top_logprobs)
            if out.finish_reason is not None:
                del streams[out.request_id]

    def _lost(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.lost_reason = reason
        streams, self._streams = self._streams, {}
        for hook in self.lost_hooks:
            try:
                hook(self.epoch, list(streams))
            except Exception:  # bookkeeping must not keep the streams from ending
                log.exception("lost hook failed")
        for s in streams.values():
            s.worker_lost = True
            s.push([], "error", f"worker unavailable: {reason}")
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(WorkerUnavailable(reason))
        self.lost.set()
