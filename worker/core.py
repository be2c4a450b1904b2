"""EngineCore: add / abort / step over a Runner, with no sockets.

The core owns every request's lifecycle inside the worker:

    (COMPILING) --> WAITING --(admitted)--> RUNNING --(stop | length | abort | error)--> retired
                       ^                           |
                       +--(step out of memory)-----+

Retirement happens exactly once per request and always produces one terminal
RequestOutput (finish_reason set), so the gateway can release its side. A
request that fails validation is retired at once with finish_reason
"rejected" (the gateway answers 400), never inserted into the batch.

Containment: validation is total (it returns a reason for any decodable Add,
never raises), and an exception while adding, inserting or constraining one
request retires that request ("rejected" before it has a batch row, "error"
after), never the process. A request with a grammar waits in COMPILING while
its matcher compiles on the constraint pool (worker/constraints.py), then
joins the waiting queue; a grammar that fails, or takes longer than
`grammar_compile_timeout_s`, is rejected.

A step that runs out of device memory (another process took what the
governor counted on) ends no request and not the process: every row is
dropped unread, the prefix cache emptied, the governor's budget lowered
below what the step held, and each running request goes back to the head
of the queue (RUNNING --> WAITING) to recompute its prompt and the tokens it
has already sent, then goes on from there (`_recover`). A greedy stream's
output is unchanged; a seeded one's sampler starts from its seed again. A
request in flight for `OUT_OF_MEMORY_STEPS` such steps, or that no longer
fits the lowered budget, ends with an error. Any other exception from the
generator's step belongs to no one request: it escapes and ends the process
(the supervisor restarts it), as does an out-of-memory step in a worker
group, whose ranks cannot recover in step.

Threading: one thread (the engine thread in `proc`, or a test) calls every
method. `step()` returns at most one StepOutputs holding all new tokens of all
requests, so the process wrapper sends one frame per engine step.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.exit_codes import is_out_of_memory
from protocol.messages import Add, RequestOutput, SamplingParams, StepOutputs
from protocol.worker_config import WorkerConfig
from worker import batch_padding, prompt_attention
from worker.backend import (
    allocated_bytes,
    decode_rows,
    fused_step,
    parse_buckets,
    profile,
    ragged_decode,
    uses_prompt_attention,
)
from worker.constraints import CompileJob, GrammarLimits
from worker.governor import Governor, GovernorConfig, default_budget_bytes
from worker.prefix_cache import PrefixCache
from worker.runner import Runner, backend_name, cap_memory, device_memory_bytes, memory_stats
from worker.scheduler import Row, Scheduler, SchedulerConfig, pass_shape
from worker.step_trace import StepTrace, open_step_trace

log = logging.getLogger("mlxd.worker.core")

# A request running through this many out-of-memory steps ends with an error
# (`EngineCore._recover`): the first one lowered the budget, so a second means
# the device keeps losing memory, and the rows in flight are shed.
OUT_OF_MEMORY_STEPS = 2


@dataclass(slots=True)
class Request:
    msg: Add
    arrival: float
    uid: int | None = None
    generated: int = 0
    prefill_done: bool = False
    admitted_at: float | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0
    constraint: Any = None  # worker/constraints.py processor, built before WAITING
    job: CompileJob | None = None  # its compilation while COMPILING
    # Prefill progress as the budget sees it (worker/scheduler.Row): prompt
    # tokens its prompt passes have left (the last one included with the
    # runner's chunk start; otherwise mlx-lm holds it back for a pass of its
    # own, worker/fused.py), and the KV length so far.
    remaining: int = 0
    kv: int = 0
    # The tokens sent so far, which a row rebuilt after an out-of-memory step
    # recomputes (`EngineCore._recover`), and how many such steps it ran through.
    tokens: list[int] = field(default_factory=list)
    out_of_memory: int = 0

    def prompt(self) -> list[int]:
        """What the row's prompt pass covers: the prompt, and after a recovery the
        tokens already sent."""
        return [*self.msg.prompt, *self.tokens] if self.tokens else self.msg.prompt


@dataclass(slots=True)
class StepPlan:
    """One step's decisions: admissions (request id, prefix-cache bytes to evict
    first) in order, the prefill chunk size, and whether the planner paced it
    (a worker group's other ranks never plan, so it does not travel)."""

    chunk: int
    admit: list[tuple[str, int]] = field(default_factory=list)
    paced: bool = False


@dataclass(slots=True)
class Counters:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_rejected: int = 0
    out_of_memory_steps: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


class EngineCore:
    def __init__(
        self,
        runner: Runner,
        scheduler: SchedulerConfig,
        epoch: int = 0,
        *,
        memory_budget_bytes: int,
        kv_budget_bytes: int = 0,
        prefix_cache_bytes: int = 0,
        grammar: GrammarLimits | None = None,
        background_compile: bool = True,
        step_trace: StepTrace | None = None,
        recover: bool = True,
    ) -> None:
        self.runner = runner
        # Whether an out-of-memory step is recovered in place (`_recover`); a
        # worker group's ranks cannot, so theirs ends the process.
        self.recover = recover
        self.step_trace = step_trace  # worker/step_trace.py; None: off
        if grammar is not None:
            runner.constraints.configure(grammar)
        # A worker group compiles on the engine thread: every rank must admit
        # the same request at the same step.
        self.background_compile = background_compile
        self._compiling: dict[str, Request] = {}
        # Called on a compile-pool thread when a compilation ends (the worker
        # wakes its engine loop with it).
        self.on_compiled: Callable[[], None] | None = None
        self.epoch = epoch
        self.scheduler: Scheduler[Request] = Scheduler(scheduler)
        info = runner.info
        self.governor = Governor(
            GovernorConfig(memory_budget_bytes, info.kv_bytes_per_token, kv_budget_bytes),
            info.weights_bytes,
        )
        self.prefix_cache = PrefixCache(
            info.identity,
            prefix_cache_bytes,
            charge=functools.partial(allocated_bytes, backend=backend_name()),
        )
        self.requests: dict[str, Request] = {}
        self._by_uid: dict[int, Request] = {}
        self._pending: list[RequestOutput] = []  # terminal outputs produced outside step()
        self._removals: list[int] = []  # aborted rows, dropped at the next step (_settle)
        self.counters = Counters()
        # (monotonic time at end of step, seconds, decoding rows, prompt tokens)
        self.step_log: deque[tuple[float, float, int, int]] = deque(maxlen=8192)
        self.last_step_at = time.monotonic()
        self.warmup_s = 0.0
        # Warm-up calibration only (worker/calibrate.py): a fixed chunk, and
        # whether a step's duration feeds the cost model (not a first-use pass).
        self._forced_chunk: int | None = None
        self._learn = True
        self.warming = False  # inside warmup(): its steps are no user's

    # -- commands -----------------------------------------------------------

    def add(self, msg: Add) -> None:
        self.counters.requests_added += 1
        if not self.requests and self.governor.restore():
            # Lowered by an out-of-memory step (`_recover`); an idle worker risks
            # no request by trying the configured budget again.
            self._cap_memory(self.governor.budget)
            log.info("idle: the memory budget is back to %.1f MiB", self.governor.budget / 2**20)
        try:
            error = self._validate(msg)
            if error:
                self._reject(msg.request_id, error)
                return
            req = Request(msg, time.monotonic())
            if msg.constraint and self.background_compile:
                req.job = self.runner.constraints.submit(msg.constraint, self._compiled)
                self.requests[msg.request_id] = req
                self._compiling[msg.request_id] = req
                return
            if msg.constraint:
                req.constraint = self.runner.constraints.make(msg.constraint)
        except Exception as e:  # containment: this request's failure, not the worker's
            self._reject(msg.request_id, _why(e), unexpected=not isinstance(e, ValueError))
            return
        self.requests[msg.request_id] = req
        self.scheduler.push(msg.request_id, req, msg.priority)

    def _compiled(self) -> None:
        """On a compile-pool thread: pass the news on (read at call time, so a hook
        set after the request was added still hears it)."""
        hook = self.on_compiled
        if hook is not None:
            hook()

    def _reject(self, request_id: str, error: str, unexpected: bool = False) -> None:
        if unexpected:
            log.warning("request %.64s rejected by an exception: %s", request_id, error)
        self.counters.requests_rejected += 1
        self._pending.append(RequestOutput(request_id, [], "rejected", error=error))

    def _poll_compiles(self) -> None:
        """Move requests whose matcher is ready into the waiting queue; reject failures."""
        if not self._compiling:
            return
        now, timeout = time.monotonic(), self.runner.constraints.limits.timeout_s
        for rid, req in list(self._compiling.items()):
            job = req.job
            assert job is not None
            if not job.future.done():
                if job.overdue(now, timeout):
                    del self._compiling[rid]
                    self.requests.pop(rid, None)
                    self._reject(
                        rid, f"the grammar took over {timeout:g} s to compile (grammar limits)"
                    )
                continue
            del self._compiling[rid]
            req.job = None
            try:
                req.constraint = job.future.result()
            except Exception as e:
                self.requests.pop(rid, None)
                self._reject(rid, _why(e), unexpected=not isinstance(e, ValueError))
                continue
            self.scheduler.push(rid, req, req.msg.priority)

    def compile_ready(self) -> bool:
        """Whether a compilation has ended or run over (a step would move it on)."""
        now, timeout = time.monotonic(), self.runner.constraints.limits.timeout_s
        return any(
            r.job is not None and (r.job.future.done() or r.job.overdue(now, timeout))
            for r in self._compiling.values()
        )

    def needs_step(self) -> bool:
        """Whether step() has anything to do now (requests only compiling: not yet)."""
        return bool(self._pending) or self._unsettled() or self.wants_step() or self.compile_ready()

    def abort(self, request_ids: list[str]) -> None:
        """Retire these requests now: their terminal outputs go out before the next
        step (take_pending); their batch rows are dropped at its start (_settle)."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue  # already retired: aborts are idempotent
            self.counters.requests_aborted += 1
            self.governor.release(rid)
            if self._compiling.pop(rid, None) is not None and req.job is not None:
                req.job.future.cancel()  # a compile already running finishes unused
            elif req.uid is None:
                self.scheduler.remove(rid)
            else:
                self._removals.append(req.uid)
                del self._by_uid[req.uid]
            self._pending.append(RequestOutput(rid, [], "abort"))

    def _unsettled(self) -> bool:
        """Aborted rows still in the batch, or kept states not yet in the prefix cache."""
        return bool(self._removals) or self.prefix_cache.queued

    def _settle(self) -> None:
        """At the start of a step, after the last one's outputs and the aborts'
        confirmations left: drop aborted rows from the batch, and put the states
        kept from finished and aborted requests into the prefix cache.

        Removing a row waits for the step mlx-lm already queued on the device
        (it reads the batch's padding back), so doing it when the abort
        arrived held its confirmation for about one more step; the kept
        states are only queued (PrefixCache.flush). No step runs in between:
        an aborted row never produces another token.
        """
        removals, self._removals = self._removals, []
        if removals:
            # A request cut short by a stop string is often the prefix of the
            # next turn: keep what it computed.
            kept = self.runner.remove(removals, keep_caches=self.prefix_cache.enabled)
            for cache, tokens in kept.values():
                if len(tokens) > 1:
                    self.prefix_cache.insert(list(tokens), cache)
        self.prefix_cache.flush()

    def abort_all(self) -> None:
        self.abort(list(self.requests))

    def warmup(
        self, prompt_tokens: int = 256, max_tokens: int = 8, calibrate_s: float = 2.0
    ) -> float:
        """Run throwaway requests so first-use costs are not a user's latency.

        First the runner's padded pass sizes (Runner.warm_shapes, CUDA). One
        greedy request compiles the prefill and decode paths and seeds the
        estimates (prefill rate, decode step) and the temporary-memory term;
        beside it a shorter one samples (temperature, top-p, a seed, a logit
        bias) and retires from the middle of three rows while the others
        still decode, so the sampler's and the logit bias's kernels and the
        gathers of a row leaving the batch are compiled here too. On a fresh
        H200 (session 22, the 0.5B shape's C=64 sweep run twice on one
        machine) the first run stalled 6.7 s in a decode step of its warm-up
        wave and 3.9 s in a timed one while MLX compiled two gather kernels
        (`gather_axis_bfloat16_int32`, `gather_int32_int32_1`), and the
        second, its kernel cache filled, not at all. With the sampled row
        leaving beside one other (session 23) the first was gone and the
        second still cost a 2.7 s step at C=32: a row leaving from the middle
        (the rows that stay indexed by an array, worker/batch_padding.py).
        Then, within about `calibrate_s` seconds, worker/calibrate.py runs a
        prefill pass at each chunk bucket (warming those shapes and fitting the
        cost model) and paces one prompt beside two decoding requests, so the
        first user's long prompt meets a calibrated budget and warm shapes.
        A worker group passes 0: its ranks must take identical steps, and
        calibration stops by each rank's own clock; rank 0 then learns the
        costs from live steps.
        Nothing of either stays: counters, prefix cache and requests are reset.
        Returns the seconds it took.
        """
        from worker.calibrate import calibrate

        start = time.perf_counter()
        if sizes := self.runner.warm_shapes():
            log.info("warmed %d pass sizes in %.2fs", sizes, time.perf_counter() - start)
        vocab = max(self.runner.info.vocab_size, 2)
        prompt = [(7 * i + 3) % vocab for i in range(prompt_tokens)]
        self.add(Add("__warmup__", prompt, max_tokens, SamplingParams(temperature=0.0)))
        sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=0, logit_bias={"0": -1.0})
        short = max(1, max_tokens // 2)
        self.add(Add("__warmup_sampled__", prompt[: max(1, prompt_tokens // 2)], short, sampled))
        # Shortest prompt: the sampled row sits between the other two whether
        # the batch keeps arrival order or sorts by length, so it leaves from
        # the middle and the rows that stay are gathered, not sliced.
        third = prompt[: max(1, prompt_tokens // 4)]
        self.add(Add("__warmup_third__", third, max_tokens, SamplingParams(temperature=0.0)))
        self.warming = True
        try:
            self._learn = False  # first-use compiles: not what these shapes cost
            while self.has_work():
                self.step()
            self._learn = True
            if calibrate_s > 0:
                log.info("cost model calibrated: %s", calibrate(self, calibrate_s))
        finally:
            self.warming = False
        self.prefix_cache.clear()
        self.prefix_cache.stats = type(self.prefix_cache.stats)()
        self.counters = Counters()
        self.warmup_s = time.perf_counter() - start
        return self.warmup_s

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self._pending) or self._unsettled()

    # -- the step -----------------------------------------------------------

    def take_pending(self) -> StepOutputs | None:
        """Terminal outputs produced between steps (aborts, rejections), without a step.

        Sent at once so an abort's retirement reaches the gateway without waiting
        for the next (possibly long) generator step.
        """
        if not self._pending:
            return None
        outputs, self._pending = self._pending, []
        return StepOutputs(self.epoch, self.counters.steps, outputs)

    def wants_step(self) -> bool:
        """Whether a generator step has anything to do (running or waiting requests)."""
        return bool(self._by_uid) or bool(self.scheduler.waiting())

    def step(self, plan: StepPlan | None = None, *, planned: bool = False) -> StepOutputs | None:
        """Admit, run one generator step, and collect its outputs.

        Alone, the core plans its own step. In a worker group, rank 0 plans
        (`plan_step`) and every other rank runs the same plan, so all ranks'
        generators take identical steps.
        """
        self._settle()
        if not planned:
            self._poll_compiles()
        outputs, self._pending = self._pending, []
        if plan is None and not planned and self.wants_step():
            plan = self.plan_step()
        if plan is not None:
            outputs.extend(self._run_step(plan))
        if not outputs:
            return None
        return StepOutputs(self.epoch, self.counters.steps, outputs)

    def idle(self) -> None:
        """What the worker does as it goes idle, so that none of it falls on the
        next request: the prefix cache takes in the entries of the requests
        that just finished (PrefixCache.flush, otherwise the next lookup's
        work: about 0.75 ms for a 2,000-token entry on the H200's host, a
        warm shared-prefix turn's TTFT), and the step trace writes its lines
        (a system call no step should pay)."""
        self.prefix_cache.flush()
        if self.step_trace is not None:
            self.step_trace.flush()

    def release_idle_buffers(self, after_s: float = 0.0) -> bool:
        """Give MLX's cached buffers back, if it holds any, once no request is
        left and no step has run for `after_s`; whether it did. The worker waits
        worker/proc.py's IDLE_RELEASE_S rather than releasing the moment the
        batch empties: a request that follows at once (the next turn of a chat,
        a client at concurrency 1) then reuses the buffers instead of
        allocating every one anew on the device."""
        if self.requests or not memory_stats()["cache_bytes"]:
            return False
        if time.monotonic() - self.last_step_at < after_s:
            return False
        self.runner.release_buffers()
        return True

    def plan_step(self) -> StepPlan:
        """Decide this step: which waiting requests enter the batch, and the chunk size.

        The scheduler sizes the step from its cost model (worker/scheduler.py):
        while streams decode, several waiting prompts may join the rows already
        prefilling as long as the step stays within its time budget.
        """
        prefilling = self._prefilling_rows()
        slots = self.scheduler.prefill_slots(len(self._by_uid), len(prefilling))
        candidates = self.scheduler.head(slots)
        held = self.runner.held_back_tokens
        rows = [Row(max(0, len(r.msg.prompt) + len(r.tokens) - held)) for r in candidates]
        prefix_bytes = self.prefix_cache.nbytes

        def fits(tokens: int, span: int) -> bool:
            return self.governor.pass_fits(tokens, span, prefix_bytes)

        chunk, n = self.scheduler.plan_prefill(self.streams(), prefilling, rows, fits)
        if self._forced_chunk is not None:
            chunk = self._forced_chunk
        plan = StepPlan(chunk=chunk, paced=self.scheduler.planned_paced)
        for req in candidates[:n]:
            m = req.msg
            need = self.governor.need(len(m.prompt), m.max_tokens)
            ok, evict = self.governor.admit(m.request_id, need, self.prefix_cache.nbytes)
            if not ok:
                break  # deferred: it stays at the head until memory frees up
            self.scheduler.pop()
            plan.admit.append((m.request_id, evict))
        return plan

    def streams(self) -> int:
        """Decoding rows that pacing protects from the prompts waiting or
        prefilling (the newcomers): rows with at least `settle_tokens` tokens
        that entered the batch before the oldest newcomer arrived. A row that
        entered after it was waiting beside the newcomers, so it came with the
        same arrival (a wave admitted `prefill_batch` prompts per step) and is
        part of the burst, not a stream to pace it for (worker/scheduler.py)."""
        settle = self.scheduler.config.settle_tokens
        arrivals = [r.arrival for r in self.scheduler.firsts()]
        arrivals += [r.arrival for r in self._by_uid.values() if not r.prefill_done]
        since = min(arrivals, default=None)
        return sum(
            1
            for r in self._by_uid.values()
            if r.generated >= settle
            and (since is None or (r.admitted_at is not None and r.admitted_at < since))
        )

    def _prefilling_rows(self) -> list[Row]:
        return [Row(r.remaining, r.kv) for r in self._by_uid.values() if not r.prefill_done]

    def follow_plan(self, plan: StepPlan) -> None:
        """On a follower rank: take the admissions rank 0 decided (see step())."""
        for rid, _ in plan.admit:
            req = self.scheduler.remove(rid)
            if req is not None:
                m = req.msg
                self.governor.reserve(rid, self.governor.need(len(m.prompt), m.max_tokens))

    def _run_step(self, plan: StepPlan) -> list[RequestOutput]:
        runner = self.runner
        decoding = runner.decoding
        runner.prefill_chunk = plan.chunk
        outputs: list[RequestOutput] = []
        admit_start = time.perf_counter()
        for rid, evict in plan.admit:
            admitted = self.requests[rid]
            try:
                self._insert(admitted, evict)
            except Exception as e:  # containment: this request fails, the batch goes on
                log.warning("request %.64s failed at insert: %s", rid, _why(e))
                outputs.append(RequestOutput(rid, [], "error", error=_why(e)))
                self._retire(admitted, "error")
        prefilling = [r for r in self._by_uid.values() if not r.prefill_done and r.remaining]
        shape = pass_shape([Row(r.remaining, r.kv) for r in prefilling], plan.chunk)
        admit_s = time.perf_counter() - admit_start if plan.admit else 0.0
        trace = self.step_trace
        joined = len(plan.admit)
        predicted = self.scheduler.predicted_step_s(decoding, shape, joined) if trace else 0.0
        fused_before = runner.fused_steps
        start = time.perf_counter()
        try:
            result = runner.step()
        except Exception as e:
            if not (self.recover and is_out_of_memory(e)):
                raise
            return outputs + self._recover(e)
        seconds = time.perf_counter() - start
        fused = runner.fused_steps > fused_before
        for r in prefilling:
            piece = min(plan.chunk, r.remaining)
            r.remaining -= piece
            r.kv += piece
        self.counters.steps += 1
        self.counters.prompt_tokens += result.prompt_tokens
        self.counters.generated_tokens += len(result.tokens)
        self.last_step_at = time.monotonic()
        self.step_log.append((self.last_step_at, seconds, decoding, result.prompt_tokens))
        if self._learn and not result.settled:  # two passes teach neither estimate
            self.scheduler.observe_step(
                seconds, decoding, result.prompt_tokens, shape, joined, paced=plan.paced
            )
        if trace is not None:
            self._trace_step(
                trace, plan, (seconds, predicted, admit_s), decoding, result, shape, fused
            )
        self._observe_scratch(result.scratch_bytes, decoding, result.prompt_tokens, shape)
        for uid in result.prefill_done:
            if (req := self._by_uid.get(uid)) is not None:
                req.prefill_done = True

        failed = self._retire_failed(result.failed, outputs)
        for ev in result.tokens:
            req = self._by_uid.get(ev.uid)
            if req is None or ev.uid in failed:
                continue
            req.generated += 1
            req.tokens.append(ev.token)
            req.prefill_done = True
            first = req.first_token_at is None
            if first:
                req.first_token_at = self.last_step_at
            outputs.append(
                RequestOutput(
                    req.msg.request_id,
                    [ev.token],
                    ev.finish_reason,
                    logprobs=None if ev.logprob is None else [ev.logprob],
                    top_logprobs=None if ev.top_logprobs is None else [ev.top_logprobs],
                    cached_tokens=req.cached_tokens if first else 0,
                    queued_s=_seconds(req.arrival, req.admitted_at) if first else 0.0,
                    prefill_s=_seconds(req.admitted_at, self.last_step_at) if first else 0.0,
                )
            )
            if ev.finish_reason is not None:
                if ev.cache is not None and ev.all_tokens:
                    self.prefix_cache.insert(list(ev.all_tokens), ev.cache)
                self._retire(req, ev.finish_reason)
        return outputs

    def _observe_scratch(
        self, scratch: int, decoding: int, prompt_tokens: int, shape: tuple[int, int, int]
    ) -> None:
        """Teach the governor a step's scratch. A new high is logged with what
        admission now sets aside (docs/architecture.md, "The memory governor")."""
        span = shape[1] + shape[2]  # the pass's furthest row end
        if self.governor.observe_scratch(scratch, prompt_tokens, span):
            g = self.governor
            log.info(
                "step scratch %.1f MiB is a new high (%d decoding, %d prompt tokens, live KV "
                "%.1f MiB, span %d); the governor sets aside %.1f MiB, a %d-token pass "
                "(rates per span: %s)",
                scratch / 2**20,
                decoding,
                prompt_tokens,
                self.runner.live_bytes / 2**20,
                span,
                g.temporary / 2**20,
                g.reserve_tokens,
                {b: f"{r / 2**10:.0f} KiB" for b, r in sorted(g.scratch_rates.items())},
            )

    def _trace_step(
        self,
        trace: StepTrace,
        plan: StepPlan,
        times: tuple[float, float, float],
        decoding: int,
        result: Any,
        shape: tuple[int, int, int],
        fused: bool,
    ) -> None:
        """One line of the step trace (worker/step_trace.py). `times`: the step's
        own seconds, the cost model's prediction, and the admitted requests'
        inserts (prefix-cache lookup and copy) before it."""
        seconds, predicted, admit_s = times
        trace.record(
            t=round(self.last_step_at, 6),
            s=round(seconds, 6),
            predicted_s=round(predicted, 6),
            admit_s=round(admit_s, 6),
            decoding=decoding,
            prompt_tokens=result.prompt_tokens,
            chunk=plan.chunk,
            pass_tokens=shape[0],
            kv=shape[1],
            pass_chunk=shape[2],
            admitted=len(plan.admit),
            fused=fused,
            scratch_mib=round(result.scratch_bytes / 2**20, 3),
            learned=self._learn and not result.settled,
            warmup=self.warming,
        )

    def _retire_failed(self, failed: dict[int, str], outputs: list[RequestOutput]) -> set[int]:
        """End the rows whose processor or constraint failed in this step, with an error.

        Their token of this step is dropped: it may be the EOS a failed constraint forces.
        """
        if not failed:
            return set()
        uids = []
        for uid, error in failed.items():
            req = self._by_uid.get(uid)
            if req is None:
                continue
            uids.append(uid)
            outputs.append(RequestOutput(req.msg.request_id, [], "error", error=error))
            self._retire(req, "error")
        self.runner.remove(uids)
        return set(failed)

    def _insert(self, req: Request, evict: int) -> None:
        """Give an admitted request its batch row, starting from any cached prefix."""
        m = req.msg
        if evict > 0:
            self.prefix_cache.trim_to(self.prefix_cache.nbytes - evict)
        prompt = req.prompt()
        cache, reused = self.prefix_cache.lookup(prompt, self.scheduler.prefill_s_per_token.value)
        if req.first_token_at is None:
            req.cached_tokens = reused
        req.remaining = max(0, len(prompt) - reused - self.runner.held_back_tokens)
        req.kv = reused
        req.prefill_done = False
        req.uid = self.runner.insert(
            prompt[reused:],
            m.max_tokens - req.generated,
            m.sampling,
            m.stop_token_ids,
            logprobs=m.logprobs,
            top_logprobs=m.top_logprobs,
            cache=cache,
            cached_tokens=prompt[:reused],
            constraint=req.constraint,
        )
        req.admitted_at = time.monotonic()
        self._by_uid[req.uid] = req

    def _recover(self, failure: BaseException) -> list[RequestOutput]:
        """After a step that ran out of device memory: drop every row unread (its
        arrays may be a graph whose evaluation failed), give the prefix cache's
        and MLX's cached buffers back, lower the budget below what the step held,
        and queue the running requests again, first and in arrival order, to
        recompute what they covered (module docstring). Returns the errors of
        the requests that cannot go on."""
        self.counters.out_of_memory_steps += 1
        held = self.runner.drop_all()
        self.prefix_cache.clear()
        running = sorted(self._by_uid.values(), key=lambda r: r.arrival)
        self._by_uid.clear()
        for req in running:
            req.uid = None
            req.out_of_memory += 1
            self.governor.release(req.msg.request_id)
        going_on = [r.msg for r in running if r.out_of_memory < OUT_OF_MEMORY_STEPS]
        keep = (
            self.governor.need(len(going_on[0].prompt), going_on[0].max_tokens) if going_on else 0
        )
        budget = self.governor.out_of_memory(held, keep)
        self._cap_memory(budget)
        outputs: list[RequestOutput] = []
        for req in reversed(running):  # each goes first: the oldest ends up first
            m = req.msg
            if req.out_of_memory >= OUT_OF_MEMORY_STEPS:
                error = (
                    f"the device ran out of memory {req.out_of_memory} times while this "
                    "request was running"
                )
            elif not self.governor.could_ever_fit(self.governor.need(len(m.prompt), m.max_tokens)):
                error = (
                    "the device ran out of memory, and this request no longer fits the memory left"
                )
            else:
                self.scheduler.push(m.request_id, req, m.priority, front=True)
                continue
            outputs.append(RequestOutput(m.request_id, [], "error", error=error))
            self._retire(req, "error")
        log.warning(
            "a step ran out of device memory (%s) holding %.1f MiB: %d running requests "
            "requeued, %d ended; the memory budget is now %.1f MiB",
            _why(failure),
            held / 2**20,
            len(running) - len(outputs),
            len(outputs),
            budget / 2**20,
        )
        return outputs

    def _cap_memory(self, budget: int) -> None:
        """MLX's memory limit follows the budget where the backend caps it (core_for)."""
        if profile(backend_name()).cap_memory:
            cap_memory(budget)

    def _retire(self, req: Request, reason: str) -> None:
        self.requests.pop(req.msg.request_id, None)
        self.governor.release(req.msg.request_id)
        if req.uid is not None:
            self._by_uid.pop(req.uid, None)
            # The generator already dropped finished rows; remove() is a no-op then.
        self.counters.requests_finished += 1
        self.counters.finish_reasons[reason] = self.counters.finish_reasons.get(reason, 0) + 1

    # -- validation and stats ----------------------------------------------

    def _validate(self, msg: Add) -> str | None:
        info = self.runner.info
        if msg.request_id in self.requests:
            return f"duplicate request id {msg.request_id[:64]!r}"
        if not msg.prompt:
            return "the prompt is empty"
        if msg.max_tokens <= 0:
            return "max_tokens must be at least 1"
        if len(msg.prompt) + msg.max_tokens > info.context_length:
            return (
                f"prompt ({len(msg.prompt)} tokens) + max_tokens ({msg.max_tokens}) exceeds "
                f"the context length of {info.context_length}"
            )
        vocab = info.vocab_size
        bound = vocab or 1 << 31  # unknown vocabulary: still an int32 for MLX
        if any(t < 0 or t >= bound for t in msg.prompt):
            return f"prompt token ids must be in [0, {bound})"
        if any(t < 0 or t >= bound for t in msg.stop_token_ids):
            return f"stop token ids must be in [0, {bound})"
        if not self.governor.could_ever_fit(self.governor.need(len(msg.prompt), msg.max_tokens)):
            return (
                f"prompt ({len(msg.prompt)} tokens) + max_tokens ({msg.max_tokens}) needs more "
                f"KV memory than this worker's budget allows"
            )
        if not 0 <= msg.top_logprobs <= 20:
            return "top_logprobs must be between 0 and 20"
        return _check_sampling(msg.sampling, vocab)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        steps = list(self.step_log)[-64:]
        return {
            "epoch": self.epoch,
            "load_time_s": self.runner.info.load_time_s,
            "warmup_s": self.warmup_s,
            "active": len(self._by_uid),
            "queued": self.scheduler.waiting(),
            "compiling": len(self._compiling),
            "queued_by_priority": self.scheduler.waiting_by_priority(),
            "requests": len(self.requests),
            "batch_rows": self.runner.active,
            "decoding": self.runner.decoding,
            "steps": c.steps,
            "prompt_tokens": c.prompt_tokens,
            "generated_tokens": c.generated_tokens,
            "requests_added": c.requests_added,
            "requests_finished": c.requests_finished,
            "requests_aborted": c.requests_aborted,
            "requests_rejected": c.requests_rejected,
            "out_of_memory_steps": c.out_of_memory_steps,
            "finish_reasons": dict(c.finish_reasons),
            "prefill_chunk": self.runner.prefill_chunk,
            "decode_step_s": self.scheduler.decode_step_s.value,
            "prefill_s_per_token": self.scheduler.prefill_s_per_token.value,
            "recent_step_s": [round(s[1], 6) for s in steps],
            "memory": {**memory_stats(), "peak_bytes": self.runner.peak_bytes},
            "governor": self.memory_terms(),
            "prefix_cache": self.prefix_cache.snapshot(),
        }

    def expected_step_s(self) -> float:
        """The longest step to expect: the slowest recent one, or a full prefill chunk.

        Read from the heartbeat thread: a racy but harmless read of floats.
        """
        # list(deque) copies in one C call under the GIL, so it is safe while the
        # engine thread appends; iterating the deque itself from this thread is not.
        recent = max((s[1] for s in list(self.step_log)[-64:]), default=0.0)
        per_token = self.scheduler.prefill_s_per_token.value or 0.0
        chunk = self.scheduler.config.prefill_chunk * self.scheduler.config.prefill_batch
        # Requests only compiling take no step until a grammar is ready: that wait
        # is bounded by the compile time limit, and is not a wedge.
        compiling = self.runner.constraints.limits.timeout_s if self._compiling else 0.0
        return max(recent, per_token * chunk, compiling)

    def memory_terms(self) -> dict[str, Any]:
        mem = memory_stats()
        return self.governor.terms(
            self.runner.live_bytes,
            self.prefix_cache.nbytes,
            mem["active_bytes"],
            mem["cache_bytes"],
        )

    def step_timeline(self, since: float = 0.0) -> list[list[float]]:
        return [[t, s, float(d), float(p)] for t, s, d, p in self.step_log if t >= since]


# The longest decimal token id accepted: ten digits hold any 32-bit id, and a
# bound keeps int() far from Python's digit limit (a 5,001-digit key raised there).
_MAX_ID_DIGITS = 10


def _check_sampling(s: SamplingParams, vocab: int) -> str | None:
    """Why these sampling parameters cannot run, or None; total over decodable values."""
    floats = (s.temperature, s.top_p, s.min_p, s.presence_penalty, s.frequency_penalty)
    if not all(math.isfinite(x) for x in (*floats, s.repetition_penalty)):
        return "sampling parameters must be finite numbers"
    if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0 or not 0 <= s.min_p <= 1:
        return "invalid sampling parameters"
    if s.repetition_penalty <= 0:
        return "repetition_penalty must be positive"
    if vocab and s.top_k >= vocab:
        return f"top_k must be below the vocabulary size {vocab}"
    if s.seed is not None and not -(2**63) <= s.seed < 2**64:
        return "seed must fit in 64 bits"
    for k, bias in s.logit_bias.items():
        if not (0 < len(k) <= _MAX_ID_DIGITS and k.isascii() and k.isdigit()):
            return f"logit_bias key {k[:24]!r} is not a token id"
        if not int(k) < (vocab or 1 << 31):
            return f"logit_bias key {k!r} is not a token id"
        if not math.isfinite(bias):
            return "logit_bias values must be finite numbers"
    return None


def _why(e: BaseException) -> str:
    """A request's error text from an exception: its type and first line, bounded."""
    text = str(e).strip().splitlines()
    detail = text[0][:300] if text else ""
    return detail if isinstance(e, ValueError) and detail else f"{type(e).__name__}: {detail}"


def _seconds(start: float | None, end: float | None) -> float:
    return max(0.0, end - start) if start is not None and end is not None else 0.0


def scheduler_config(cfg: WorkerConfig, backend: str) -> SchedulerConfig:
    """The scheduler's sizes from the worker's configuration and its backend's profile."""
    prof = profile(backend)
    buckets = parse_buckets(cfg.chunk_buckets) or prof.chunk_buckets
    return SchedulerConfig(
        max_batch=cfg.max_batch,
        prefill_batch=cfg.prefill_batch,
        prefill_chunk=cfg.prefill_chunk,
        pacing=cfg.pacing,
        pacing_factor=cfg.pacing_factor or prof.pacing_factor,
        pacing_slack=cfg.pacing_slack,
        admission_cost=cfg.admission_cost,
        min_chunk=min(prof.min_chunk, cfg.prefill_chunk),
        chunk_buckets=buckets,
    )


def runner_for(cfg: WorkerConfig, model_path: Path, group: Any = None) -> Runner:
    """The loaded model and generator a worker runs for `cfg`: one place for the
    worker process and the benchmark's engine target (as `core_for` is)."""
    batch_padding.host_padding = cfg.host_padding  # process-wide, as mlx-lm's guard is
    prompt_attention.enabled = uses_prompt_attention(cfg.prompt_attention, backend_name())
    return Runner(
        model_path,
        max_batch=cfg.max_batch,
        prefill_batch=cfg.prefill_batch,
        prefill_chunk=cfg.prefill_chunk,
        group=group,
        fused=fused_step(cfg.fused_step, backend_name(), cfg.group_size),
        idle_read=cfg.idle_read,
        join_read=cfg.join_read,
        pad_rows=profile(backend_name()).pad_rows and cfg.group_size == 1,
        ragged_decode=ragged_decode(cfg.decode_attention, backend_name()),
        decode_rotary=cfg.decode_rotary,
        decode_rows=decode_rows(cfg.decode_rows, backend_name()),
    )


def core_for(cfg: WorkerConfig, runner: Runner, epoch: int | None = None) -> EngineCore:
    """The engine a worker runs for `cfg` on a loaded runner (not yet warmed up).

    One place for the worker process and the benchmark's in-process engine, so
    the benchmark measures the engine the worker actually builds.
    """
    budget = cfg.memory_budget_bytes or default_budget_bytes(device_bytes=device_memory_bytes())
    if profile(backend_name()).cap_memory:
        cap_memory(budget)
    return EngineCore(
        runner,
        scheduler_config(cfg, backend_name()),
        epoch=cfg.epoch if epoch is None else epoch,
        memory_budget_bytes=budget,
        kv_budget_bytes=cfg.kv_budget_bytes,
        prefix_cache_bytes=cfg.prefix_cache_bytes,
        grammar=GrammarLimits(
            threads=cfg.grammar_compile_threads,
            timeout_s=cfg.grammar_compile_timeout_s,
            max_bytes=cfg.grammar_max_bytes,
        ),
        background_compile=cfg.group_size == 1,
        step_trace=open_step_trace(cfg.step_trace),
        recover=cfg.group_size == 1,
    )
