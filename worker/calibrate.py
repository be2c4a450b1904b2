"""Warm-up calibration of the prefill cost model (worker/scheduler.py's CostModel).

Runs inside `EngineCore.warmup`, on the engine thread, before the worker
reports ready; nothing it adds stays (the warm-up resets counters and caches).

Two phases within a time budget, every step waiting for its own prompt pass
(`calibrate`'s docstring says why):
1. Idle passes, one chunk bucket at a time from the smallest: a prompt of two
   chunks (KV 0, then KV = chunk), run twice with fresh tokens; the cost model
   skips each shape's first pass itself (it pays the shape's compile). The next bucket
   is skipped once the model predicts it would overrun the budget (on a slow
   machine the largest buckets stay cold; the model extrapolates to them), or
   once the memory governor says its second pass's scratch would not fit
   (`Governor.pass_fits`, from the scratch the smaller buckets taught it): on
   the H200 (session 15) the 2,048-token pass over 2,048 cached tokens of the
   8B shape held 11.8-12.9 GB, which a smaller GPU beside 16 GB of weights
   does not have, and a worker that runs out of memory in its warm-up never
   becomes ready.
2. Two prompts paced one after the other beside two decoding requests with
   the live planner, so the decode-step estimate and paced passes (batch rows
   beside decode rows) are measured and their shapes warm. The second is
   there for the model: the cost model skips each shape's first pass (its
   compile) and the first step of each prompt prices its admission instead,
   so one prompt taught it one or two passes beside decode rows in a GPU's
   few large chunks: at the first paced step of all eight 0.5B runs of
   sessions 36-40 and three of the twenty 8B runs the model held 0-2 such
   passes, and their fixed cost ranged from 2.2 to 53 ms (`bench.cost_replay`;
   session 41, docs/benchmarks/README.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from protocol.messages import Add, SamplingParams

if TYPE_CHECKING:
    from worker.core import EngineCore

GREEDY = SamplingParams(temperature=0.0)
PACED_PROMPTS = 2  # the second teaches the shapes the first compiled (module doc)


def calibrate(core: EngineCore, budget_s: float) -> dict[str, Any]:
    """Fit the cost model within about `budget_s` seconds; returns what it learned.

    Every step waits for its own prompt pass meanwhile (`Runner.timed_passes`):
    the worker queues a pass without waiting for it (session 9), so its device
    time lands in the next step's duration, and each calibration prompt's big
    passes are followed by its 1-token last pass. On the H200 (session 10) the
    fit came out as a 13.9 ms fixed cost with no cost per token, where one
    2,048-token pass costs about 17 ms and a 64-token one 7
    (`bench.pass_probe`); the planner then put a whole 2,000-token prompt into
    one paced step of 28.7 ms. The misplaced device time is our reading of
    that fit; timing each pass in its own step is not yet measured there.
    """
    runner = core.runner
    timed = runner.timed_passes
    runner.timed_passes = True
    try:
        return _calibrate(core, budget_s)
    finally:
        runner.timed_passes = timed


def _calibrate(core: EngineCore, budget_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    deadline = start + budget_s
    sched = core.scheduler
    context = core.runner.info.context_length
    vocab = max(core.runner.info.vocab_size, 2)
    warmed: list[int] = []
    for i, bucket in enumerate(sched.buckets):
        n = 2 * bucket + 1
        if n + 8 > context:
            break
        if sched.cost.ready:
            one_run = sched.cost.predict(bucket, 0, bucket) + sched.cost.predict(
                bucket, bucket, bucket
            )
            if time.perf_counter() + 2 * one_run > deadline:
                break
        elif time.perf_counter() > deadline:
            break
        if not core.governor.pass_fits(bucket, 2 * bucket, core.prefix_cache.nbytes):
            break  # the forced chunk bypasses the planner's own cut to memory
        for run in (3, 5):
            tokens = [(11 * j + 7 * i + run) % vocab for j in range(n)]
            _run_idle(core, tokens, bucket)
        warmed.append(bucket)
    if core.scheduler.config.pacing:
        _paced(core, max(0.25 * budget_s, deadline - time.perf_counter()), vocab)
    return {
        "seconds": round(time.perf_counter() - start, 3),
        "warm_buckets": warmed,
        "coef": [float(f"{c:.4g}") for c in sched.cost.predict_coef()],
        "decode_step_s": sched.decode_step_s.value,
    }


def _run_idle(core: EngineCore, prompt: list[int], chunk: int) -> None:
    core._forced_chunk = chunk
    try:
        core.add(Add("__calibrate_idle__", prompt, 1, GREEDY))
        while core.has_work():
            core.step()
    finally:
        core._forced_chunk = None


def _paced(core: EngineCore, budget_s: float, vocab: int) -> None:
    """Two decoding requests, a few steady steps, then `PACED_PROMPTS` prompts
    paced beside them one after the other (streams outnumbering the prompt:
    never a burst, which would not be paced)."""
    sched = core.scheduler
    context = core.runner.info.context_length
    n = min(sched.config.prefill_chunk, context - 64)
    decoders = ["__calibrate_decode_0__", "__calibrate_decode_1__"]
    prompts = [f"__calibrate_prefill_{i}__" for i in range(PACED_PROMPTS)]
    decode_tokens = min(context - 8, n + 64)
    for i, rid in enumerate(decoders):
        core.add(Add(rid, [3, 5, 7, 11 + i], decode_tokens, GREEDY))
    stop_at = time.perf_counter() + budget_s
    # Until both are streams (settle_tokens or more), then a few
    # steady decode steps: the budget's unit.
    while core.streams() < len(decoders) and all(d in core.requests for d in decoders):
        core.step()
    for _ in range(8):
        core.step()
    for i, prompt in enumerate(prompts):
        # fresh tokens each: a prompt the prefix cache held would not be prefilled
        core.add(Add(prompt, [(5 * j + 1 + 3 * i) % vocab for j in range(n)], 1, GREEDY))
        while prompt in core.requests and time.perf_counter() < stop_at:
            core.step()
    core.abort([*decoders, *prompts])
    while core.has_work():
        core.step()
