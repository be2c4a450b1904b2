"""Admission order and prefill pacing. Pure logic: no MLX, no sockets.

The engine thread owns the scheduler. Each step it asks which waiting requests
may enter the batch and how many prompt tokens the step may prefill.

Pacing: mlx-lm's BatchGenerator runs one decode step for every active sequence,
then one prefill chunk, per `next()`. A 2048-token chunk therefore stalls every
decoder for as long as the chunk takes. While anything decodes we keep one
prompt in prefill at a time and size its chunk so that a step with a chunk costs
at most about `pacing_factor` decode steps, from two running measurements: the
steady decode step time and the prefill rate. With nothing decoding, prefill
runs at full width and chunk size, so an idle server's TTFT does not regress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

INTERACTIVE = 0
BATCH = 1
PRIORITIES = (INTERACTIVE, BATCH)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch: int = 32
    prefill_batch: int = 8
    prefill_chunk: int = 2048
    pacing: bool = True
    # A paced step aims at this many steady decode steps: 1.5 leaves headroom under
    # the 2x promise for the noise in both estimates.
    pacing_factor: float = 1.5
    min_chunk: int = 16
    initial_paced_chunk: int = 128


class Ewma:
    """Exponentially weighted mean; None until the first sample."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class Scheduler(Generic[T]):
    """FIFO within a priority; interactive before batch."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queues: dict[int, deque[tuple[str, T]]] = {p: deque() for p in PRIORITIES}
        self.decode_step_s = Ewma()
        self.prefill_s_per_token = Ewma()

    def push(self, request_id: str, item: T, priority: int = INTERACTIVE) -> None:
        self._queues[priority if priority in self._queues else BATCH].append((request_id, item))

    def remove(self, request_id: str) -> T | None:
        for q in self._queues.values():
            for i, (rid, item) in enumerate(q):
                if rid == request_id:
                    del q[i]
                    return item
        return None

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting_by_priority(self) -> dict[str, int]:
        return {"interactive": len(self._queues[INTERACTIVE]), "batch": len(self._queues[BATCH])}

    def peek(self) -> T | None:
        for p in PRIORITIES:
            if self._queues[p]:
                return self._queues[p][0][1]
        return None

    def pop(self) -> T:
        for p in PRIORITIES:
            if self._queues[p]:
                return self._queues[p].popleft()[1]
        raise IndexError("no waiting request")

    def prefill_slots(self, running: int, prefilling: int, decoding: int) -> int:
        """How many waiting requests may be inserted into the generator now."""
        free = self.config.max_batch - running
        # One paced prompt at a time while streams decode.
        width = 1 if self.config.pacing and decoding > 0 else self.config.prefill_batch
        return max(0, min(free, width - prefilling, self.waiting()))

    def chunk_size(self, decoding: int) -> int:
        """Prompt tokens one step may process for each prefilling sequence."""
        full = self.config.prefill_chunk
        if not self.config.pacing or decoding == 0:
            return full
        d, p = self.decode_step_s.value, self.prefill_s_per_token.value
        if d is None or p is None or p <= 0:
            return min(full, self.config.initial_paced_chunk)
        budget_s = (self.config.pacing_factor - 1.0) * d
        return int(max(self.config.min_chunk, min(full, budget_s / p)))

    def observe_step(self, seconds: float, decoding: int, prompt_tokens: int) -> None:
        """Feed one step's duration back into the pacing estimates."""
        if decoding and not prompt_tokens:
            self.decode_step_s.add(seconds)
        elif prompt_tokens:
            base = (self.decode_step_s.value or 0.0) if decoding else 0.0
            self.prefill_s_per_token.add(max(seconds - base, 1e-6) / prompt_tokens)
