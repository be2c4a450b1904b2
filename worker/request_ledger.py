"""Which thread ends a request towards the gateway: the request ledger of one connection.

Every request the gateway sends gets exactly one terminal output back
(finish_reason set). Usually the engine thread sends it, in the step that
ends the request. An abort is the exception: the reader thread confirms it
the moment it reads the Abort, instead of leaving it in the inbox until the
engine thread's step in flight returns (on the H200 a paced prefill step
takes 16-40 ms, and a cancellation waited for it: issue #12, item 4). The
engine thread still carries the abort out at its next loop turn (the row
leaves the batch at the next step's start, the memory reservation is
released, the abort is counted); the ledger makes sure nothing it sends for
the request after the confirmation reaches the gateway, so the request ends
exactly once and no token follows its end.

    (Add read) --> OPEN --(the engine thread sends its terminal output)--> CLOSED
                     |
                     +--(Abort read: the reader thread sends "abort")--> CLOSED

A request is open from the moment the reader thread reads its Add (before
the engine thread sees it), so an Abort that overtakes its Add in the inbox
is confirmed at once too, and the engine's later "rejected" or "abort" for it
is dropped.

What the confirmation promises: the worker sends nothing more for the
request, and its row computes nothing after the step in flight (which the
device already runs and cannot be recalled). What it does not: the row and
its memory are released at the engine thread's next loop turn, at most one
step later; admission runs only after that, so memory is never
double-counted.

Threading: `opened` and `abort` run on the reader thread, `send_outputs` on
the engine thread. One lock covers the open set and the put onto the writer's
outbox, so the order of frames on the socket is the order of decisions here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from protocol.messages import RequestOutput, StepOutputs


class RequestLedger:
    def __init__(self, epoch: int, put: Callable[[StepOutputs], None]) -> None:
        self._epoch = epoch
        self._put = put  # onto the writer's outbox (it may block: backpressure)
        self._lock = threading.Lock()
        self._open: set[str] = set()
        self._step = 0  # the last step number sent: an abort's frame carries it

    def opened(self, request_id: str) -> None:
        """The reader read this request's Add (before the engine thread sees it)."""
        with self._lock:
            self._open.add(request_id)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Confirm the aborts of the open requests among these now; return them.

        Requests already closed (finished, or aborted before) get nothing: their
        terminal output has gone out.
        """
        with self._lock:
            ended = [rid for rid in dict.fromkeys(request_ids) if rid in self._open]
            if ended:
                self._open.difference_update(ended)
                outputs = [RequestOutput(rid, [], "abort") for rid in ended]
                self._put(StepOutputs(self._epoch, self._step, outputs))
            return ended

    def send_outputs(self, msg: StepOutputs) -> None:
        """Send the engine thread's outputs of the open requests; close those they end.

        Outputs of closed requests (aborted while the step ran, or never opened on
        this connection) are dropped. A frame left with no outputs still goes out
        when it carries stats (none does today), so nothing but those is lost.
        """
        with self._lock:
            self._step = max(self._step, msg.step)
            kept = []
            for out in msg.outputs:
                if out.request_id not in self._open:
                    continue
                if out.finish_reason is not None:
                    self._open.discard(out.request_id)
                kept.append(out)
            if kept or msg.stats:
                same = len(kept) == len(msg.outputs)
                self._put(msg if same else StepOutputs(msg.epoch, msg.step, kept, msg.stats))

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)
