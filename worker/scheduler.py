"""Admission order and prefill pacing. Pure logic: no MLX, no sockets.

The engine thread owns the scheduler. Each step it asks which waiting requests
may enter the batch and how many prompt tokens the step may prefill.

Pacing: mlx-lm's BatchGenerator runs one decode step for every active sequence,
then one prefill chunk, per `next()`. A 2048-token chunk therefore stalls every
decoder for as long as the chunk takes. While anything decodes, a step may
prefill one chunk-sized token budget (one long prompt, or several short ones
that fit in it together), and the chunk size is steered by feedback over
power-of-two sizes (few distinct shapes for Metal and CUDA to compile):

Only steps that prefilled at least half a chunk steer it: a short prompt's fast
step says nothing about what a full chunk would cost.

- a paced step within `pacing_factor` steady decode steps: the chunk doubles;
- a slower one: the chunk halves, but only while halving actually buys time.
  Each chunk is one more model pass plus a host sync, a fixed cost that on a
  GPU is most of a small chunk's step: when half the chunk costs about as much
  (the measured cost per size says so), shrinking would only stretch the
  prompt's TTFT, so the chunk grows instead, up to the largest size that costs
  about the same as the smallest. That finds the knee of the cost curve: the
  largest chunk before prefill compute starts to stall the decoders.

With nothing decoding, prefill runs at full width and chunk size, so an idle
server's TTFT does not regress. The worker's warm-up paces one long prompt
beside a decoding request (EngineCore.warmup), so the controller has learned
this machine's chunk costs before the first user's long prompt arrives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.worker_config import DEFAULTS

INTERACTIVE = 0
BATCH = 1
PRIORITIES = (INTERACTIVE, BATCH)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # The worker knobs' defaults live once, in its launch contract.
    max_batch: int = DEFAULTS.max_batch
    prefill_batch: int = DEFAULTS.prefill_batch
    prefill_chunk: int = DEFAULTS.prefill_chunk
    pacing: bool = DEFAULTS.pacing
    # A paced step may take this many steady decode steps before the chunk halves.
    pacing_factor: float = 2.0
    min_chunk: int = 16
    initial_paced_chunk: int = 512


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
        self.prefill_s_per_token = Ewma()  # idle prefill rate: reported, and prefix savings
        self.paced_chunk = _pow2_floor(min(config.initial_paced_chunk, config.prefill_chunk))
        self.chunk_cost: dict[int, Ewma] = {}  # paced step seconds by chunk size

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
        if self.paced(decoding) and prefilling:
            return 0  # while streams decode, new prompts wait for the current prefill
        return max(0, min(free, self.config.prefill_batch - prefilling, self.waiting()))

    def paced(self, decoding: int) -> bool:
        return self.config.pacing and decoding > 0

    def chunk_size(self, decoding: int) -> int:
        """Prompt tokens one step may process for each prefilling sequence."""
        if not self.config.pacing or decoding == 0:
            return self.config.prefill_chunk
        return self.paced_chunk

    def observe_step(self, seconds: float, decoding: int, prompt_tokens: int) -> None:
        """Feed one step's duration back into the pacing controller and estimates."""
        if decoding and not prompt_tokens:
            self.decode_step_s.add(seconds)
        elif prompt_tokens and not decoding:
            self.prefill_s_per_token.add(seconds / prompt_tokens)
        elif (
            self.config.pacing
            and self.decode_step_s.value is not None
            and prompt_tokens >= self.paced_chunk // 2
        ):
            self._steer(seconds)

    def _steer(self, seconds: float) -> None:
        cfg = self.config
        chunk, top = self.paced_chunk, _pow2_floor(cfg.prefill_chunk)
        cost = self.chunk_cost.setdefault(chunk, Ewma(0.5))
        cost.add(seconds)
        here = cost.value or seconds

        def known(c: int) -> float | None:
            e = self.chunk_cost.get(c)
            return e.value if e is not None else None

        if seconds <= cfg.pacing_factor * (self.decode_step_s.value or seconds):
            self.paced_chunk = min(chunk * 2, top)
            return
        half, double = chunk // 2, min(chunk * 2, top)
        half_cost, double_cost = known(half), known(double)
        if half >= cfg.min_chunk and (half_cost is None or half_cost < 0.8 * here):
            self.paced_chunk = half  # smaller chunks are cheaper: shrink
        elif double_cost is None or double_cost <= 1.25 * here:
            self.paced_chunk = double  # overhead-bound: bigger chunks cost the same


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)
