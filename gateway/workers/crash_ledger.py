"""Which crashes count against a model's crash budget, and which requests are poison.

The rule (docs/reliability.md#replay-and-the-crash-budget):

- Every worker death is noted with the internal ids of the requests that were
  in flight on it (`WorkerClient.lost_hooks`, called synchronously before the
  supervisor records the crash).
- A request in flight for its first death is replayed once (if it has not sent
  its client a byte yet); in flight for `POISON_DEATHS` deaths, it is poison:
  the gateway drops it with an error naming the crash and never replays it
  again (gateway/serving/generation.Generation).
- The deaths a poison request was in flight for are forgiven: they do not count
  against the crash budget, which measures crashes that no dropped request
  explains (a broken model, memory pressure, a bad machine). So two, or twenty,
  poison requests cost two crashes each and leave the model serving, while a
  worker that dies on its own still ends in FAILED.

Threading: event loop only. Memory is bounded: at most `max_requests` request
ids and 1024 forgiven epochs are remembered (the oldest are forgotten first).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque

log = logging.getLogger("mlxd.gateway.supervisor")

POISON_DEATHS = 2  # in flight for this many worker deaths: the request is dropped


class CrashLedger:
    def __init__(self, window_s: float, max_requests: int = 4096) -> None:
        self.window_s = window_s
        self._max_requests = max_requests
        self._deaths: OrderedDict[str, list[int]] = OrderedDict()  # request -> epochs
        self._forgiven: set[int] = set()  # epochs whose deaths a poison request explains
        self._crashes: deque[tuple[float, int]] = deque()  # (monotonic time, epoch)
        self.poisoned = 0  # requests dropped as poison so far

    def worker_lost(self, epoch: int, request_ids: list[str]) -> None:
        """A worker of `epoch` died (or its connection broke) with these requests in flight."""
        for rid in request_ids:
            epochs = self._deaths.pop(rid, [])
            if epoch not in epochs:
                epochs.append(epoch)
            self._deaths[rid] = epochs  # most recent last
            if len(epochs) >= POISON_DEATHS:
                self.poisoned += 1
                self._forgive(epochs)
                log.warning(
                    "request %s was in flight for %d worker deaths (epochs %s): dropped, "
                    "not replayed; those crashes do not count against the crash budget",
                    rid,
                    len(epochs),
                    epochs,
                )
        while len(self._deaths) > self._max_requests:
            self._deaths.popitem(last=False)

    def deaths(self, request_id: str) -> int:
        """How many worker deaths this request was in flight for."""
        return len(self._deaths.get(request_id, ()))

    def _forgive(self, epochs: list[int]) -> None:
        self._forgiven.update(epochs)
        if len(self._forgiven) > 1024:  # only recent epochs can still be recorded or counted
            self._forgiven = set(sorted(self._forgiven)[-512:])
        self._crashes = deque(c for c in self._crashes if c[1] not in self._forgiven)

    def record_crash(self, epoch: int, now: float | None = None) -> int:
        """Note the crash of `epoch`'s worker; returns the crashes that count in the window."""
        now = time.monotonic() if now is None else now
        if epoch not in self._forgiven:
            self._crashes.append((now, epoch))
        while self._crashes and now - self._crashes[0][0] > self.window_s:
            self._crashes.popleft()
        return len(self._crashes)

    def reset(self) -> None:
        """A fresh budget (after a FAILED model's cool-down)."""
        self._crashes.clear()
