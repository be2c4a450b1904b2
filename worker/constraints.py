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

Threading: `Constraints` is created on the engine thread and builds the
llguidance tokenizer (about a second for a 50k vocabulary) on a helper thread;
processors are created and called on the engine thread only. A processor never
raises: BatchGenerator runs every row's processor inside one step, so an exception
would fail the whole batch. A matcher that reaches an error state forces EOS.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlxd.worker.constraints")

Processor = Callable[[mx.array, mx.array], mx.array]

_NEG_INF = float("-inf")


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


class Constraints:
    """Makes per-request processors for one model's tokenizer and vocabulary."""

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos_ids: Sequence[int]) -> None:
        self.n_vocab = max(n_vocab, len(hf_tokenizer))
        self.eos_ids = tuple(eos_ids)
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

    def make(self, text: str) -> ConstraintProcessor:
        """A fresh processor for one request; ValueError for a spec it cannot run."""
        spec = ConstraintSpec.parse(text)
        matcher = None
        if spec.grammar:
            import llguidance

            tokenizer = self._tokenizer_future().result()  # the first one waits for the build
            matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"invalid grammar: {matcher.get_error()}")
        r = spec.reasoning
        if r is not None and any(t >= self.n_vocab for t in r.start + r.end):
            raise ValueError("constraint.reasoning token ids are outside the vocabulary")
        return ConstraintProcessor(self, matcher, r)

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
                self.failed = m.get_error() or f"token {token} rejected"
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
                self.failed = f"{type(e).__name__}: {e}"
                log.exception("constraint processor failed")
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
