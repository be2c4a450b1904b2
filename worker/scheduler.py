"""Admission order, the prefill cost model and the per-step prefill budget. Pure
logic: no MLX, no sockets (numpy for the cost model's fit).

The engine thread owns the scheduler. Each step it asks which waiting requests
may enter the batch and how many prompt tokens each prefilling row may process
(the chunk), given the rows already prefilling.

Cost model (`CostModel`): the seconds of one prefill pass as a function of its
shape, fitted by least squares on the passes this process has run:

    seconds = a + b*T + e*K + c*T*K + d*T*L

T: the pass's tokens (rows x padded chunk length L), K: the longest KV length
the rows attend over before the pass. `a` is the fixed cost of a pass (launch,
host sync; most of a small pass on a GPU), learned twice: once for a pass
alone and once for one beside decode rows, whose cost is the step's duration
less the steady decode step. A fused step (worker/fused.py) pays the fixed
cost once for both, so a prompt chunk beside decode rows costs less than the
same chunk alone: on the H200 (session 20, llama8b, the step trace) one
intercept fitted to both kinds predicted 24-28 ms for 256-token paced steps
that took 17-20, and the planner left a third of its budget unused. Until
three passes beside decode rows are learned, the model gives them the lone
pass's fixed cost (the conservative side; one pass's fixed cost is that
pass's noise). `b` the per-token weights work,
`e` reading the cache once per pass (what makes a short chunk over a long
cache dear on MLX's CPU attention), `c` attention over the cache, `d`
attention within the chunk (what makes one huge chunk slower than several
smaller ones on the CPU). The
worker's warm-up calibrates it (EngineCore.warmup runs idle passes at each
chunk bucket), and every later step refines it; a paced step's prefill cost is
its duration less the steady decode step.

Budget (`Scheduler.plan_prefill`):
- while anything decodes (paced), a step may take `pacing_factor` steady decode
  steps: the prefill part gets `(pacing_factor - 1)` decode steps. Waiting
  prompts join the rows already prefilling as long as a chunk bucket still
  fits the budget for all rows (a burst is admitted several prompts per step),
  and the chunk is the largest bucket that fits. When even the smallest bucket
  exceeds the budget (a pass's fixed cost is above it, as on a GPU), the
  budget widens to what the smallest costs times `pacing_slack` (1.25: plus
  a quarter): the fixed cost is paid anyway, so the step carries as many
  tokens as cost about the same. On the H200 (session 21, llama8b, 16
  streams, bench.pacing_probe --chunk) a 256-token fused step cost about
  what a 128-token one did (20-25 against 22-27 ms) where the planner,
  whose fitted slope is steeper than that, took 128 in the standard
  preset. At 2 (session 22, through mlxd, two pairs) the long prompt's
  TTFT fell from 2.93 / 2.75x idle to 1.70 / 1.87x and the streams' p99
  gap rose from 24-26 to 34-36 ms: a trade, not a gain, so 1.25 stays.
  Measuring each chunk size beside the streams and trying the next bucket
  up (`pacing_explore`, sessions 23-24) cut llama8b's long-prompt TTFT
  from 2.55-2.66x idle to 1.59-1.82x on the H200 but broke the streams'
  gap (2.91-3.90x): its first try carried 1,024 tokens beside 16 streams.
  It was removed in session 28 (docs/architecture.md).
  A paced pass carries at most twice the prompt tokens of the largest paced
  pass run so far (`largest_paced`; the smallest bucket before any): the
  cost model is trusted only a doubling beyond what it has seen. On the H200
  (session 18, llama8b, the step trace) a model fitted on 208-512-token
  paced passes predicted 32 ms for a whole 2,000-token prompt beside 16
  streams; the step took 58 ms and the next 52, against 16 ms steady.
  Only passes the planner paced count (`planned_paced`, the step's
  `paced`): before session 42 every pass beside decode rows did, and a
  burst's admission beside the rows of its own wave (4,000 tokens and more
  in every run of session 42's H100 job) lifted the bound past any prompt.
  In that job's 8B run a refit left the model pricing a pass beside decode
  rows by its KV alone (1 ms for 1,227 tokens); the planner took the
  prompt's last 1,227 tokens in one step, which took 61 ms against 10.4
  steady, where the bound from the warm-up's paced passes (256 tokens)
  would have allowed 512.
- with `admission_cost` (on by default since session 32), a
  paced step that admits requests is priced with what admitting one has
  cost beyond its pass: the median, over the last 16 paced steps that
  admitted, of what each took beyond the cost model's prediction, per
  request (`admit_s`). The pass model has no term for it, and on session
  31's H200 and H100 traces the steps that admitted took about 1.6x their
  prediction while paced steps without an admission came within a few
  percent: the admitting step is the streams' p99 gap under mixed pressure
  on both shapes (23.9 ms where 16.2 was predicted, llama8b). Replayed over
  30 archived traces (`bench.cost_replay`, variant `admit-term`: 1,457 paced
  steps) the mean absolute log error fell from 0.318 to 0.206, and
  predicted/took from 0.86 to 0.99. On an H100 (session 32, off and on
  alternated twice a shape) the admitting steps' took/predicted went from
  1.98-2.5 to 1.06-1.11, and llama8b's streams' p99 gap under mixed
  pressure from 42 and 38 ms to 31 and 31 ms; the 0.5B shape's stayed
  within its noise (14.4, 12.6 against 15.4, 12.3 ms), and neither shape's
  long-prompt TTFT moved.
- a burst (at least two prompts waiting or prefilling, and at least as many
  as the streams): planned as if idle. Streams (`EngineCore.streams`) are
  the decoding rows with at least `settle_tokens` (2) tokens that entered
  the batch before the oldest prompt waiting or prefilling arrived. A row
  that has delivered at most its first token came with the same arrival as
  the prompts still waiting (a wave of requests reaches the worker over
  several steps as the gateway tokenizes it, and its first rows enter the
  decode batch while the rest wait); so did a row that entered after they
  arrived (a wave larger than `prefill_batch` enters over several steps, and
  its first rows settle while its tail waits). Either is part of the burst,
  not a stream to protect from it. A stream that has sent two tokens is one
  a client watches (the benchmark's cancellation scenarios start their
  prompts then). Pacing protects streams
  from a minority of newcomers; when the newcomers are as many as the
  streams, their first tokens count as much, and paced steps would cost the
  burst its throughput as well (a GPU pass has a fixed cost of several ms, so
  small paced passes waste it). This is what mlx-lm's BatchGenerator does for
  every arrival.
- idle (no streams: nothing decodes, or only rows at their first token):
  no pacing limit; up to `prefill_batch` prompts enter
  and the chunk is the bucket the model predicts prefills the longest of them
  fastest (not simply the largest: on the CPU one 2048-token chunk is slower
  than several smaller ones).
- memory: the plan is then cut until the memory governor's `pass_fits` says
  the pass's scratch fits (on CUDA it grows with the pass's tokens and span):
  fewer newcomers first, then smaller buckets, never below one smallest pass.
Chunks come from a fixed list of buckets (`chunk_buckets`), so steady
operation meets few distinct pass shapes for Metal and CUDA to compile; the
warm-up runs each once. A prompt's last chunk is its remainder, not a bucket.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

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
    # A paced step may take this many steady decode steps (decode + prefill).
    # The launch contract's 0 means the backend's (worker/core.py,
    # `scheduler_config`); this is CUDA's and Metal's (worker/backend.py).
    pacing_factor: float = 2.0
    # A paced step whose smallest chunk is predicted over the budget may carry
    # a chunk predicted to cost up to this multiple of the smallest's.
    pacing_slack: float = DEFAULTS.pacing_slack
    # Price a paced step's admissions (`Scheduler.admit_s`, module doc).
    admission_cost: bool = DEFAULTS.admission_cost
    min_chunk: int = 16
    # A decoding row is a stream that pacing protects once it has this many
    # tokens; before that it belongs to the arrival it came with (module doc).
    settle_tokens: int = 2
    # Chunk sizes a step may use; () means powers of two from min_chunk to
    # prefill_chunk (worker/backend.py picks them per backend).
    chunk_buckets: tuple[int, ...] = ()

    def buckets(self) -> tuple[int, ...]:
        if self.chunk_buckets:
            return tuple(sorted({b for b in self.chunk_buckets if 0 < b <= self.prefill_chunk}))
        out, b = [], max(1, self.min_chunk)
        while b < self.prefill_chunk:
            out.append(b)
            b *= 2
        return (*out, self.prefill_chunk)


class Ewma:
    """Exponentially weighted mean; None until the first sample."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


Features = tuple[float, float, float, float, float, float]
N_TERMS = 6
ADMIT_WINDOW = 16  # admitting steps the admission cost is the median over
MIN_KIND_PASSES = 3  # passes of a kind (alone, beside) its own fixed cost needs
# Feature indices: the two fixed costs (module doc), then the shared terms.
ALONE, BESIDE, TOKENS = 0, 1, 2


def _features(tokens: int, kv: int, chunk: int, beside: bool) -> Features:
    return (
        0.0 if beside else 1.0,
        1.0 if beside else 0.0,
        float(tokens),
        float(kv),
        float(tokens) * kv,
        float(tokens) * chunk,
    )


class CostModel:
    """Seconds of one prefill pass from (tokens, KV length, chunk length) and
    whether it runs beside decode rows (`beside`); see the module doc.

    Least squares over the last `window` passes, refitted lazily; coefficients
    are kept non-negative (a negative term would make big passes look free).
    Until it has seen passes of at least two different sizes it knows nothing
    (`ready` is False). Once it has `settled` passes, a prediction refits only
    after `refit_every` new ones: the fit runs on the engine thread, between
    steps, and one more pass among hundreds hardly moves it.
    """

    def __init__(self, window: int = 256, settled: int = 32, refit_every: int = 4) -> None:
        self.samples: deque[tuple[Features, float]] = deque(maxlen=window)
        self.coef: Features = (0.0,) * N_TERMS  # type: ignore[assignment]
        self.settled, self.refit_every = settled, refit_every
        self._fresh = 0  # passes learned since the last fit
        self._outliers = 0
        self._seen: set[tuple[int, int, bool]] = set()  # (tokens, chunk, beside) passed before

    def observe(
        self, tokens: int, kv: int, chunk: int, seconds: float, beside: bool = False
    ) -> bool:
        """Add one pass; False when it was dropped as an outlier.

        The first pass of each (tokens, chunk) shape is not learned from: on a GPU
        it pays for compiling that shape's kernels. A later pass far slower than
        predicted is dropped too (a compile for a new KV length, a neighbour's
        process), unless such passes keep coming (then the machine really got
        slower).
        """
        if tokens <= 0 or seconds <= 0:
            return False
        shape = (tokens, chunk, beside)
        if shape not in self._seen:
            # The first pass of a shape compiles its kernels on Metal and CUDA
            # (60-75 ms on the H200, whatever the size): not what it costs later.
            self._seen.add(shape)
            return False
        if self.ready and seconds > 4 * self.predict(tokens, kv, chunk, beside) + 1e-3:
            self._outliers += 1
            if self._outliers < 3:
                return False
        self._outliers = 0
        self.samples.append((_features(tokens, kv, chunk, beside), seconds))
        self._fresh += 1
        return True

    @property
    def ready(self) -> bool:
        # Asked only when a step plans a prompt (decode-only steps skip the model).
        return len({f[TOKENS] for f, _ in self.samples}) >= 2

    def predict(self, tokens: int, kv: int, chunk: int, beside: bool = False) -> float:
        if self._fresh and (self._fresh >= self.refit_every or len(self.samples) < self.settled):
            self._fit()
        feats = _features(tokens, kv, chunk, beside)
        return sum(c * x for c, x in zip(self.coef, feats, strict=True))

    def predict_coef(self) -> Features:
        if self._fresh:
            self._fit()
        return self.coef

    def _fit(self) -> None:
        self._fresh = 0
        if not self.ready:
            return
        # Fit on scaled features (their magnitudes differ by 10^6), dropping
        # terms that come out negative one at a time (active-set NNLS, 6 terms).
        feats = np.array([f for f, _ in self.samples], dtype=np.float64)
        seconds = np.array([sec for _, sec in self.samples], dtype=np.float64)
        coef = _nonnegative_fit(feats, seconds)
        # Once more without the passes the fit misses by over 2x (a neighbour's
        # process took the CPU, a first-use compile): noise must not steer it.
        predicted = feats @ coef
        kept = (predicted >= 0.5 * seconds) & (predicted <= 2 * seconds)
        if kept.sum() >= len(seconds) // 2 and len(np.unique(feats[kept, TOKENS])) >= 2:
            feats, seconds = feats[kept], seconds[kept]
            coef = _nonnegative_fit(feats, seconds)
        # A kind of pass seen fewer than MIN_KIND_PASSES times, and less often
        # than the other, borrows the other's fixed cost: never seen, its
        # column is all zeros and the fit left it at zero (free passes); seen
        # once, its fixed cost is whatever makes that one pass fit exactly,
        # its noise included (session 41: one 8B calibration pass beside
        # decode rows, still paying compiles, set it at 53 ms, four times
        # what such passes took).
        for few, other in ((BESIDE, ALONE), (ALONE, BESIDE)):
            seen = feats[:, few].sum()
            if seen < MIN_KIND_PASSES and seen < feats[:, other].sum():
                coef[few] = coef[other]
        self.coef = tuple(float(c) for c in coef)  # type: ignore[assignment]


def _nonnegative_fit(feats: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares, dropping the most negative term until none is (active-set NNLS)."""
    active = list(range(N_TERMS))
    while active:
        coef = _least_squares(feats, seconds, active)
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))
    return np.zeros(N_TERMS)


def _least_squares(feats: np.ndarray, seconds: np.ndarray, active: list[int]) -> np.ndarray:
    """Normal equations over the active terms, each pass weighted by 1/seconds:
    relative error, so the many small passes (the ones pacing picks) count as
    much as the few big ones. Vectorized: this runs on the engine thread
    whenever a step taught the model something (in pure Python it took 3.5 ms
    of a 9 ms paced step on the 2-core CPU)."""
    scale = np.abs(feats).max(axis=0)
    scale[scale == 0] = 1.0
    x = feats[:, active] / scale[active] / seconds[:, None]
    a = x.T @ x + 1e-9 * len(seconds) * np.eye(len(active))
    sol = np.linalg.solve(a, x.sum(axis=0))
    coef = np.zeros(N_TERMS)
    coef[active] = sol / scale[active]
    return coef


@dataclass(frozen=True, slots=True)
class Row:
    """A prefilling row as the budget sees it: prompt tokens its prompt passes
    have left (worker/core.py, Request.remaining), and the KV length it has so far."""

    remaining: int
    kv: int = 0


def pass_shape(rows: Sequence[Row], chunk: int) -> tuple[int, int, int]:
    """(tokens, kv, padded chunk) of one pass over `rows` at `chunk`: rows are
    right-padded to the longest piece, so every row costs that many tokens."""
    pieces = [min(chunk, r.remaining) for r in rows if r.remaining > 0]
    if not pieces:
        return 0, 0, 0
    length = max(pieces)
    return length * len(pieces), max(r.kv for r in rows), length


class Scheduler(Generic[T]):
    """FIFO within a priority; interactive before batch; the prefill budget per step."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queues: dict[int, deque[tuple[str, T]]] = {p: deque() for p in PRIORITIES}
        self.decode_step_s = Ewma()
        self._decode_steps: deque[float] = deque(maxlen=64)
        self.prefill_s_per_token = Ewma()  # idle prefill rate: reported, and prefix savings
        self.cost = CostModel()
        self.buckets = config.buckets()
        self.largest_paced = 0  # prompt tokens of the largest paced pass run (module doc)
        self.planned_paced = False  # whether the last plan with prompts was paced
        # What each request admitted by a paced step cost beyond the pass's
        # prediction, over the last ADMIT_WINDOW such steps (`admit_s`).
        self._admit_residuals: deque[float] = deque(maxlen=ADMIT_WINDOW)

    def push(
        self, request_id: str, item: T, priority: int = INTERACTIVE, front: bool = False
    ) -> None:
        """Queue a request last in its priority class; `front`: first (a request
        taken back out of the batch, worker/core.py's out-of-memory recovery)."""
        q = self._queues[priority if priority in self._queues else BATCH]
        if front:
            q.appendleft((request_id, item))
        else:
            q.append((request_id, item))

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

    def head(self, n: int) -> list[T]:
        """The next `n` waiting requests in admission order, without taking them."""
        out: list[T] = []
        for p in PRIORITIES:
            for _, item in self._queues[p]:
                if len(out) >= n:
                    return out
                out.append(item)
        return out

    def firsts(self) -> list[T]:
        """The longest-waiting request of each priority (each queue is FIFO)."""
        return [q[0][1] for q in self._queues.values() if q]

    def peek(self) -> T | None:
        head = self.head(1)
        return head[0] if head else None

    def pop(self) -> T:
        for p in PRIORITIES:
            if self._queues[p]:
                return self._queues[p].popleft()[1]
        raise IndexError("no waiting request")

    def prefill_slots(self, running: int, prefilling: int) -> int:
        """How many waiting requests the batch has room for (rows and prefill width)."""
        free = self.config.max_batch - running
        return max(0, min(free, self.config.prefill_batch - prefilling, self.waiting()))

    def paced(self, streams: int, newcomers: int = 0) -> bool:
        """Whether the next step is paced: streams decode (`EngineCore.streams`:
        settled rows that were in the batch before the newcomers arrived), and
        the prompts waiting or prefilling (`newcomers`) are not a burst: fewer
        than two, or fewer than the streams."""
        burst = newcomers >= 2 and newcomers >= streams
        return self.config.pacing and streams > 0 and not burst

    def prefill_budget_s(self) -> float | None:
        """Seconds a paced step may spend on prefill; None when unknown."""
        step = self.decode_unit_s()
        if step is None:
            return None
        return max(0.0, self.config.pacing_factor - 1.0) * step

    def decode_unit_s(self) -> float | None:
        """The steady decode step pacing is measured in: the 90th percentile of
        recent decode-only steps (streams see the slow ones too: the target
        compares gaps with the steady p99), the mean until there are enough."""
        if len(self._decode_steps) < 8:
            return self.decode_step_s.value
        ordered = sorted(self._decode_steps)
        return ordered[int(0.9 * (len(ordered) - 1))]

    def admit_s(self) -> float:
        """What admitting one request adds to a paced step (with `admission_cost`):
        the median of what recent admitting steps took beyond their pass's
        prediction, per request; 0 until one was seen, or when off."""
        if not (self.config.admission_cost and self._admit_residuals):
            return 0.0
        return max(0.0, statistics.median(self._admit_residuals))

    def plan_prefill(
        self,
        streams: int,
        prefilling: Sequence[Row],
        waiting: Sequence[Row],
        fits: Callable[[int, int], bool] | None = None,
    ) -> tuple[int, int]:
        """(chunk, how many of `waiting` to admit) for the next step.

        `streams`: the decoding rows pacing protects (`EngineCore.streams`).
        `waiting` holds the admission candidates in order (already cut to the
        free slots); the core may admit fewer (memory), never more.
        `fits(tokens, span)`: whether a pass of that many prompt tokens reaching
        that far (its furthest row end) fits in memory (the memory governor's
        `pass_fits`); None: any pass does.
        """
        chunk, n = self._plan(streams, prefilling, waiting)
        return self._within(prefilling, waiting, chunk, n, fits)

    def _within(
        self,
        prefilling: Sequence[Row],
        waiting: Sequence[Row],
        chunk: int,
        n: int,
        fits: Callable[[int, int], bool] | None,
    ) -> tuple[int, int]:
        """`chunk` and `n` cut until the pass `fits`: fewer newcomers first
        (they wait in the queue), then smaller buckets; one smallest-bucket
        pass always runs, so memory never stops prefill."""
        if fits is None or not (prefilling or n):
            return chunk, n  # no pass to fit (most decode steps)
        keep = 0 if prefilling else min(1, n)

        def fitting() -> bool:
            tokens, kv, length = pass_shape([*prefilling, *waiting[:n]], chunk)
            return fits(tokens, kv + length)

        while not fitting():
            if n > keep:
                n -= 1
            elif chunk > self.buckets[0]:
                chunk = max(b for b in self.buckets if b < chunk)
            else:
                break
        return chunk, n

    def _plan(
        self, streams: int, prefilling: Sequence[Row], waiting: Sequence[Row]
    ) -> tuple[int, int]:
        # The whole queue counts, not only the candidates cut to the free slots
        # (`waiting` alone when the caller plans rows it has not queued).
        newcomers = len(prefilling) + max(len(waiting), self.waiting())
        paced = self.planned_paced = self.paced(streams, newcomers)
        if not (prefilling or waiting):
            # No prompt to plan (most decode steps): what the budget would give
            # an empty pass, without the cost model (this runs every step).
            return (self.buckets[0] if paced else self.buckets[-1]), 0
        if not paced:
            rows = [*prefilling, *waiting]
            return self.idle_chunk(max((r.remaining for r in rows), default=0)), len(waiting)
        budget = self.prefill_budget_s()
        if budget is None or not self.cost.ready:
            # Nothing measured yet: one small bucket for the rows already there, or
            # one new prompt (the measurements follow from this step).
            return self.buckets[0], 0 if prefilling else min(1, len(waiting))
        smallest = self.buckets[0]
        floor_rows = list(prefilling) or list(waiting[:1])
        admit = self.admit_s()
        floor_cost = self.cost.predict(*pass_shape(floor_rows, smallest), beside=True)
        if not prefilling:
            floor_cost += admit  # the floor admits one
        # A fixed cost above the budget is paid anyway (module doc).
        budget = max(budget, self.config.pacing_slack * floor_cost)
        reach = max(smallest, 2 * self.largest_paced)
        return self._fitting(prefilling, waiting, budget, reach, admit)

    def _fitting(
        self,
        prefilling: Sequence[Row],
        waiting: Sequence[Row],
        budget: float,
        reach: int,
        admit: float,
    ) -> tuple[int, int]:
        """The largest bucket within `budget` (and `reach`), with as many of
        `waiting` as still fit, each admitted one costing `admit` beside the
        pass; one row at the smallest bucket when none does."""
        smallest = self.buckets[0]
        best = (smallest, 0 if prefilling else min(1, len(waiting)), 0)
        for n in range(len(waiting) + 1):
            rows = [*prefilling, *waiting[:n]]
            if not rows:
                continue
            shapes = [(b, pass_shape(rows, b)) for b in self.buckets]
            fit = [
                b
                for b, sh in shapes
                if sh[0] <= reach and self.cost.predict(*sh, beside=True) + n * admit <= budget
            ]
            if not fit:
                break  # more rows only cost more
            chunk = fit[-1]
            tokens = pass_shape(rows, chunk)[0]
            if tokens >= best[2]:  # ties go to more rows: a burst's prompts start together
                best = (chunk, n, tokens)
        return best[0], best[1]

    def idle_chunk(self, longest: int) -> int:
        """The bucket that prefills a `longest`-token prompt fastest by the model."""
        top = self.buckets[-1]
        if not self.cost.ready or longest <= 0:
            return top

        def total(chunk: int) -> float:
            seconds, done = 0.0, 0
            while done < longest:
                piece = min(chunk, longest - done)
                seconds += self.cost.predict(piece, done, piece)
                done += piece
            return seconds

        # The largest bucket within 5% of the fastest: fewer, larger passes when
        # the model cannot tell them apart (noise must not pick tiny chunks).
        totals = {b: total(b) for b in self.buckets}
        best = min(totals.values())
        return max(b for b, t in totals.items() if t <= 1.05 * best)

    def observe_step(
        self,
        seconds: float,
        decoding: int,
        prompt_tokens: int,
        shape: tuple[int, int, int] = (0, 0, 0),
        admitted: int = 0,
        paced: bool = False,
    ) -> None:
        """Feed one step's duration (and its prefill pass shape: tokens, kv, chunk,
        how many requests it admitted, and whether the planner paced it) into
        the decode estimate, the cost model, the admission cost and the bound
        on a paced pass (`largest_paced`, module doc)."""
        tokens, kv, chunk = shape
        if decoding and not prompt_tokens:
            self.decode_step_s.add(seconds)
            self._decode_steps.append(seconds)
            return
        if prompt_tokens and not decoding:
            self.prefill_s_per_token.add(seconds / prompt_tokens)
            prefill_s = seconds
        elif self.decode_step_s.value is not None:
            prefill_s = seconds - self.decode_step_s.value
            if paced:
                self.largest_paced = max(self.largest_paced, tokens)
        else:
            return
        admitting = tokens > 0 and admitted and decoding
        if self.config.admission_cost and admitting and self.cost.ready:
            # The admission's share goes to its own term, not into the pass
            # model (until the model is ready, admitting steps teach it too).
            predicted = self.cost.predict(tokens, kv, chunk, beside=True)
            self._admit_residuals.append((prefill_s - predicted) / admitted)
            return
        if tokens > 0 and prefill_s > 0:
            self.cost.observe(tokens, kv, chunk, prefill_s, beside=bool(decoding))

    def predicted_step_s(
        self, decoding: int, shape: tuple[int, int, int], admitted: int = 0
    ) -> float:
        decode = (self.decode_step_s.value or 0.0) if decoding else 0.0
        if not shape[0]:
            return decode
        admit = admitted * self.admit_s() if decoding else 0.0
        return decode + self.cost.predict(*shape, beside=bool(decoding)) + admit
