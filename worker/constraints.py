"""Per-request decoding constraints: grammar masks (llguidance) and thinking budgets.

The gateway compiles and validates a request's grammar (gateway/serving/grammars.py) and
sends it in `Add.constraint` as JSON:

    {"grammar": "<llguidance grammar>",            # optional
     "reasoning": {"start": [ids], "end": [ids],   # optional: the model's thinking markers
                   "active": bool,                 #   the prompt leaves a block open
                   "budget": int}}                 #   0 = unlimited

This module turns that into one mlx-lm logits processor per request. BatchGenerator
calls a row's processors as `processor(tokens_context, logits)` with the row's
tokens so far (prompt included), so each processor keeps its own matcher state and
advances it by the tokens that arrived since its last call. Masks keep batching
intact: only the constrained rows' logits change, the batch's forward pass is the
same.

A processor goes through phases:

    (open?) -> THINK -> [forcing the end marker at the budget] -> GRAMMAR | FREE

- THINK: the model is inside a reasoning block; tokens are counted, and at the
  budget the end marker is forced one token at a time. Nothing else is masked,
  except EOS when a grammar must still follow.
- GRAMMAR: the llguidance matcher's mask; EOS is allowed only when the grammar
  accepts, and once it is complete only EOS is.
- FREE: no grammar (a budget-only constraint) after the block closed.
A model that opens its reasoning block itself (its first token is a one-token
start marker) may do so before the grammar starts.

Compilation: creating a matcher compiles the grammar against the vocabulary
(about a second for a large schema on a 50k vocabulary), so `submit` runs it on a
small pool (`GrammarLimits.threads`, llguidance releases the GIL) and the request
waits until its matcher is ready; the engine thread never compiles. A compiled
matcher is probed before the request is accepted: its first mask, and the tokens
it forces from the start, must not put it in an error state. That refuses
grammars llguidance accepts but cannot generate from (a `$ref` cycle with no way
out matches nothing; an `anyOf` of thousands of objects passes the row-size limit
at the first `{`), which would otherwise end at once with a bare EOS.

Threading: `Constraints` is created on the engine thread and builds the
llguidance tokenizer (about a second for a 50k vocabulary) on a helper thread;
processors are created on a compile-pool thread (or the engine thread in a worker
group, whose ranks must stay in step) and handed over through a Future; they are
called on the engine thread only. A processor never raises: BatchGenerator runs
every row's processor inside one step, so an exception would fail the whole
batch. A matcher that reaches an error state sets `failed` and forces EOS; the
runner's row guard reports `failed`, and the core ends that request with an
error (never a plain "stop").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlxd.worker.constraints")

Processor = Callable[[mx.array, mx.array], mx.array]

_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds on grammar compilation (docs/configuration.md#grammars)."""

    threads: int = 1  # compile pool size
    timeout_s: float = 10.0  # a compile running longer fails its request
    max_bytes: int = 4 << 20  # longest grammar text accepted


def first_line(text: str, limit: int = 300) -> str:
    """An llguidance error's first line: later lines dump parser state (generated text)."""
    return (text.strip().splitlines() or [""])[0][:limit]


@dataclass(frozen=True, slots=True)
class ReasoningSpec:
    start: tuple[int, ...]
    end: tuple[int, ...]
    active: bool
    budget: int


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    grammar: str
    reasoning: ReasoningSpec | None

    @classmethod
    def parse(cls, text: str) -> ConstraintSpec:
        """The spec in an Add; ValueError names what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"constraint is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("constraint must be a JSON object")
        grammar = raw.get("grammar", "")
        if not isinstance(grammar, str):
            raise ValueError("constraint.grammar must be a string")
        reasoning = None
        r = raw.get("reasoning")
        if r is not None:
            if not isinstance(r, dict):
                raise ValueError("constraint.reasoning must be an object")
            start, end = r.get("start", []), r.get("end", [])
            budget, active = r.get("budget", 0), r.get("active", False)
            if not _ids(start) or not _ids(end) or not end:
                raise ValueError("constraint.reasoning start/end must be lists of token ids")
            if type(budget) is not int or budget < 0 or type(active) is not bool:
                raise ValueError("constraint.reasoning budget/active have the wrong type")
            reasoning = ReasoningSpec(tuple(start), tuple(end), active, budget)
        if not grammar and (reasoning is None or not reasoning.budget):
            raise ValueError("constraint has neither a grammar nor a thinking budget")
        return cls(grammar, reasoning)


def _ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int and t >= 0 for t in v)


def _lower_thread_priority() -> None:
    """Compile threads yield the CPU to the engine thread (Linux: per-thread nice).

    On a machine with few cores a compile competes with decoding for a core; a
    compile may take a little longer, a stream must not stutter. Elsewhere
    (macOS: setpriority takes a process id, not a thread's) it is left alone.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class CompileJob:
    """One request's grammar compilation on the pool: its result and when it began."""

    __slots__ = ("future", "started")

    def __init__(self) -> None:
        self.future: Future[ConstraintProcessor] = Future()
        self.started: float | None = None  # monotonic; None while queued

    def overdue(self, now: float, timeout_s: float) -> bool:
        return self.started is not None and now - self.started > timeout_s


class Constraints:
    """Makes per-request processors for one model's tokenizer and vocabulary."""

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos_ids: Sequence[int]) -> None:
        self.n_vocab = max(n_vocab, len(hf_tokenizer))
        self.eos_ids = tuple(eos_ids)
        self.limits = GrammarLimits()
        self._pool: ThreadPoolExecutor | None = None
        self._hf_tokenizer = hf_tokenizer
        self._tokenizer: Future[Any] = Future()
        self._started = threading.Lock()
        self._building = False

    def _tokenizer_future(self) -> Future[Any]:
        """llguidance's tokenizer, built at the first grammar request, not at load.

        Its build is one Rust call that holds the GIL: about a second for real
        tokenizers, but minutes for the benchmark's random-weight shapes (their
        152k-token BPE), during which a build started at load starved the
        loading thread (issue #12: 171 s from spawn to "model loaded" on the H200).
        """
        with self._started:
            if not self._building:
                self._building = True
                threading.Thread(
                    target=self._build,
                    args=(self._hf_tokenizer,),
                    name="llg-tokenizer",
                    daemon=True,
                ).start()
        return self._tokenizer

    def _build(self, hf_tokenizer: Any) -> None:
        try:
            import llguidance.hf

            tok = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=self.n_vocab, eos_token=list(self.eos_ids)
            )
            self._tokenizer.set_result(tok)
        except BaseException as e:  # reported at the first constrained request
            self._tokenizer.set_exception(e)

    def configure(self, limits: GrammarLimits) -> None:
        """Set the compile limits (before the first request; the pool starts lazily)."""
        self.limits = limits

    def submit(self, text: str, on_done: Callable[[], None] | None = None) -> CompileJob:
        """Compile on the pool; the job's future holds the processor or a ValueError.

        `on_done` runs on the pool thread when the job ends (the worker wakes its
        engine loop with it).
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max(1, self.limits.threads),
                thread_name_prefix="llg-compile",
                initializer=_lower_thread_priority,
            )
        job = CompileJob()

        def run() -> None:
            if not job.future.set_running_or_notify_cancel():
                return  # the request went away while queued
            job.started = time.monotonic()
            try:
                job.future.set_result(self.make(text))
            except BaseException as e:  # the request's own failure, reported on its future
                job.future.set_exception(e)
            if on_done is not None:
                on_done()

        self._pool.submit(run)
        return job

    def make(self, text: str) -> ConstraintProcessor:
        """A fresh processor for one request; ValueError for a spec it cannot run."""
        if len(text) > self.limits.max_bytes:
            raise ValueError(
                f"the grammar is {len(text)} bytes, over the limit of {self.limits.max_bytes} "
                "(grammar_max_bytes)"
            )
        spec = ConstraintSpec.parse(text)
        matcher = None
        if spec.grammar:
            import llguidance

            tokenizer = self._tokenizer_future().result()  # the first one waits for the build
            matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"invalid grammar: {first_line(matcher.get_error())}")
            self._probe(matcher)
        r = spec.reasoning
        if r is not None and any(t >= self.n_vocab for t in r.start + r.end):
            raise ValueError("constraint.reasoning token ids are outside the vocabulary")
        return ConstraintProcessor(self, matcher, r)

    def _probe(self, matcher: Any) -> None:
        """ValueError when the grammar fails at its start (module docstring)."""
        import llguidance.numpy as llg_np

        probe = matcher.deep_copy()
        bitmask = np.zeros((1, (self.n_vocab + 31) // 32), dtype=np.int32)
        llg_np.fill_next_token_bitmask(probe, bitmask, 0)
        if not probe.is_error():
            forced = probe.compute_ff_tokens()
            if forced and probe.consume_tokens(forced):
                llg_np.fill_next_token_bitmask(probe, bitmask, 0)
        if probe.is_error():
            raise ValueError(
                f"the grammar cannot be generated from: {first_line(probe.get_error())}"
            )
        if not bitmask.any():
            raise ValueError("the grammar cannot be generated from: it allows no token")

    def is_eos(self, ids: mx.array) -> mx.array:
        hit = ids == self.eos_ids[0]
        for t in self.eos_ids[1:]:
            hit = hit | (ids == t)
        return hit

    def unpack(self, bitmask: np.ndarray, width: int) -> mx.array:
        """A (1, width) boolean row from llguidance's int32 bitmask (bit i = token i).

        Unpacked on the host: numpy's unpackbits and one copy cost about a third
        of the same unpacking as MLX ops (a gather, a shift, a mask) on the CPU
        backend at a 49k vocabulary. Little-endian words, as on every MLX platform.
        """
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=self.n_vocab)
        allowed = bits.view(np.bool_)
        if width < self.n_vocab:
            allowed = allowed[:width]
        elif width > self.n_vocab:
            allowed = np.pad(allowed, (0, width - self.n_vocab))
        return mx.array(allowed)[None]


class ConstraintProcessor:
    """One request's constraint; called by BatchGenerator as processor(context, logits)."""

    def __init__(self, owner: Constraints, matcher: Any, reasoning: ReasoningSpec | None) -> None:
        self._owner = owner
        self._matcher = matcher
        self._r = reasoning
        self._seen: int | None = None  # context length at the last call
        self._generated = 0
        if reasoning is not None and reasoning.active:
            self.phase = "think"
        elif reasoning is not None and len(reasoning.start) == 1:
            self.phase = "open"  # the model may open its reasoning block itself
        else:
            self.phase = "grammar" if matcher is not None else "free"
        self._think_tokens = 0
        self._tail: list[int] = []  # the last tokens of the reasoning block
        self._forcing = -1  # index into the end marker while forcing it
        self._bitmask: np.ndarray | None = None
        if matcher is not None:
            self._bitmask = np.full((owner.n_vocab + 31) // 32, -1, dtype=np.int32)
        self.failed = ""

    # -- advancing -----------------------------------------------------------

    def _after_think(self) -> str:
        return "grammar" if self._matcher is not None else "free"

    def _advance(self, token: int) -> None:
        self._generated += 1
        if self.phase == "open":
            assert self._r is not None
            self.phase = "think" if token == self._r.start[0] else self._after_think()
            if self.phase == "think":
                return
        if self.phase == "think":
            r = self._r
            assert r is not None
            self._think_tokens += 1
            self._tail = [*self._tail, token][-len(r.end) :]
            if self._forcing >= 0:
                self._forcing += 1
            if tuple(self._tail) == r.end:
                self.phase, self._forcing = self._after_think(), -1
            return
        if self.phase == "grammar" and not self.failed:
            m = self._matcher
            if not m.consume_token(token):
                self.failed = first_line(m.get_error()) or f"token {token} rejected"
                # Not the matcher's error: it quotes the generated text, and no
                # log line carries prompt or output text (docs/api.md#request-log).
                log.warning("constraint failed: the grammar rejected token %d", token)

    # -- masking ---------------------------------------------------------------

    def _force(self, token: int, logits: mx.array) -> mx.array:
        ids = mx.arange(logits.shape[-1])
        return mx.where(ids == token, logits, _NEG_INF)

    def _grammar_mask(self, logits: mx.array) -> mx.array:
        assert self._bitmask is not None
        import llguidance.numpy as llg_np

        llg_np.fill_next_token_bitmask(self._matcher, self._bitmask[None], 0)
        if self._matcher.is_error():  # its mask would allow only EOS: a silent "stop"
            raise RuntimeError(first_line(self._matcher.get_error()))
        return self._owner.unpack(self._bitmask, logits.shape[-1])

    def _start_think_budget_hit(self) -> bool:
        r = self._r
        return r is not None and r.budget > 0 and self._think_tokens >= r.budget

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        try:
            n = int(context.shape[0])
            if self._seen is None:
                self._seen = n  # first call: the prompt, nothing generated yet
            elif n > self._seen:
                new = cast(list[int], context[self._seen : n].tolist())
                for t in new:
                    self._advance(int(t))
                self._seen = n
            return self._apply(logits)
        except Exception as e:  # never fail the batch
            if not self.failed:
                self.failed = first_line(f"{type(e).__name__}: {e}")
                log.warning("constraint processor failed: %s", self.failed)
            return self._force(self._owner.eos_ids[0], logits)

    def _apply(self, logits: mx.array) -> mx.array:
        if self.failed:
            return self._force(self._owner.eos_ids[0], logits)
        phase = self.phase
        if phase == "think":
            r = self._r
            assert r is not None
            if self._forcing < 0 and self._start_think_budget_hit():
                # Continue a partly written end marker rather than restarting it.
                self._forcing = next(
                    (
                        k
                        for k in range(len(r.end) - 1, 0, -1)
                        if tuple(self._tail[-k:]) == r.end[:k]
                    ),
                    0,
                )
            if self._forcing >= 0:
                return self._force(r.end[min(self._forcing, len(r.end) - 1)], logits)
            if self._matcher is not None:
                # The answer must still come: no EOS inside the reasoning block.
                ids = mx.arange(logits.shape[-1])
                return mx.where(self._owner.is_eos(ids)[None], _NEG_INF, logits)
            return logits
        if phase == "free":
            return logits
        if phase == "open":
            assert self._r is not None
            if self._matcher is None:
                return logits
            mask = self._grammar_mask(logits)
            ids = mx.arange(logits.shape[-1])
            return mx.where(mask | (ids == self._r.start[0])[None], logits, _NEG_INF)
        return mx.where(self._grammar_mask(logits), logits, _NEG_INF)
