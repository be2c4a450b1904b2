"""The worker's engine features on a real tiny model, in-process: prefill pacing,
prefix cache, memory governor, seeded sampling, logprobs."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from protocol.messages import Add, SamplingParams
from tests.worker_helpers import GREEDY, run_to_completion, tokens_of
from worker import batch_padding
from worker.core import EngineCore
from worker.runner import Runner
from worker.scheduler import BESIDE, MIN_KIND_PASSES, TOKENS, CostModel, SchedulerConfig


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> Runner:
    return Runner(tiny_model_dir, max_batch=32, prefill_batch=8, prefill_chunk=2048)


def make_core(runner: Runner, **kw: object) -> EngineCore:
    pacing = bool(kw.pop("pacing", True))
    buckets = tuple(kw.pop("chunk_buckets", ()))  # type: ignore[call-overload]
    core = EngineCore(
        runner,
        SchedulerConfig(
            max_batch=32,
            prefill_batch=8,
            prefill_chunk=2048,
            pacing=pacing,
            chunk_buckets=buckets,
        ),
        memory_budget_bytes=int(kw.pop("memory_budget_bytes", 8 << 30)),
        kv_budget_bytes=int(kw.pop("kv_budget_bytes", 0)),
        prefix_cache_bytes=int(kw.pop("prefix_cache_bytes", 64 << 20)),
    )
    assert not kw
    return core


def assert_drained(core: EngineCore) -> None:
    s = core.stats()
    assert s["active"] == 0 and s["queued"] == 0 and s["requests"] == 0
    assert s["batch_rows"] == 0
    assert s["governor"]["reserved_requests"] == 0
    assert s["governor"]["reserved_growth"] == 0
    assert s["governor"]["live_state"] == 0


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt + 11) % 480 + 10 for i in range(n)]


# -- prefill pacing ------------------------------------------------------------------


def _gaps_during_long_prefill(core: EngineCore) -> tuple[float, list[tuple[float, int]]]:
    """8 decoders run; a 2,000-token prompt arrives. Returns the steady step time and
    (step seconds, prompt tokens) of every step until that prompt's first token."""
    never_stop = SamplingParams(temperature=0.0, logit_bias={"2": -100.0, "1": -100.0, "0": -100.0})
    for i in range(8):
        core.add(Add(f"d{i}", prompt_of(16, i), 3000, never_stop))
    while core.runner.decoding < 8:
        core.step()
    for _ in range(30):
        core.step()
    steady = statistics.median(s[1] for s in list(core.step_log)[-20:])
    core.add(Add("long", prompt_of(2000, 99), 4, GREEDY))
    mark = len(core.step_log)
    while core.requests["long"].first_token_at is None:
        core.step()
    during = [(s[1], int(s[3])) for s in list(core.step_log)[mark:]]
    core.abort_all()
    core.step()
    return steady, during


def test_paced_prefill_bounds_the_decoders_stall(runner: Runner) -> None:
    """Pacing turns one long stall into many short steps.

    The 2x-of-a-decode-step target itself is measured by bench/ (timing targets
    do not belong in tests); here, in one process and one run, we assert what
    pacing controls: chunk sizes, and the worst gap relative to no pacing.
    """
    paced = make_core(runner)
    paced.warmup()
    steady, during = _gaps_during_long_prefill(paced)
    # no pacing and one chunk size: the whole prompt in one pass
    unpaced = make_core(runner, pacing=False, chunk_buckets=(2048,))
    unpaced.warmup()
    _, stalled = _gaps_during_long_prefill(unpaced)

    chunks = [p for _, p in during if p]
    assert len(chunks) >= 8, "the prompt was not split into chunks"
    assert max(chunks) < 2000  # never the whole prompt in one step
    assert [p for _, p in stalled if p] == [2000]  # one whole-prompt chunk, unpaced
    worst_paced = max(s for s, _ in during)
    worst_unpaced = max(s for s, _ in stalled)
    assert worst_unpaced > 20 * steady, "no stall to prevent: the test is not measuring"
    assert worst_paced * 5 < worst_unpaced
    assert_drained(paced)
    assert_drained(unpaced)


def test_a_prompts_kv_grown_ahead_is_not_counted_as_its_first_steps_scratch(
    tiny_model_dir: Path,
) -> None:
    """The first 64-token chunk of a 1,000-token prompt allocates the prompt's
    whole KV buffer (batch_padding.reserve): live state the governor already
    reserved, not the pass's scratch, which it learns per prompt token."""
    runner = Runner(tiny_model_dir, max_batch=4, prefill_batch=2, prefill_chunk=64)
    try:
        runner.insert(prompt_of(8, 1), 40, GREEDY)
        for _ in range(4):
            runner.step()
        runner.insert(prompt_of(1000, 2), 1, GREEDY)
        first = runner.step()
        caches = runner.generator._prompt_batch.prompt_cache
        assert caches[0].keys is not None and caches[0].keys.shape[2] == 1024  # grown ahead
        ahead = sum(c.keys.nbytes + c.values.nbytes for c in caches) * (1024 - 256) // 1024
        assert first.prompt_tokens == 64
        assert first.scratch_bytes < ahead, (first.scratch_bytes, ahead)
    finally:
        runner.close()


def test_warmup_calibrates_pacing_and_leaves_nothing_behind(runner: Runner) -> None:
    core = make_core(runner)
    core.warmup(calibrate_s=0.5)
    sched = core.scheduler
    # the cost model measured passes of several sizes, idle and beside decoders
    assert sched.cost.ready, list(sched.cost.samples)
    assert len({f[TOKENS] for f, _ in sched.cost.samples}) >= 3
    assert {f[BESIDE] for f, _ in sched.cost.samples} == {0.0, 1.0}
    # enough passes beside decode rows for that kind's own fixed cost (each
    # shape's first and each prompt's admitting step teach it nothing)
    assert sum(f[BESIDE] for f, _ in sched.cost.samples) >= MIN_KIND_PASSES
    assert sched.decode_step_s.value and sched.prefill_s_per_token.value
    stats = core.stats()
    assert stats["steps"] == 0 and stats["requests_added"] == 0  # counters reset
    assert stats["prefix_cache"]["entries"] == 0 and stats["prefix_cache"]["lookups"] == 0
    assert_drained(core)
    assert core.governor.reserved_total == 0
    uncalibrated = make_core(runner)
    uncalibrated.warmup(calibrate_s=0)
    assert not uncalibrated.scheduler.cost.ready  # the warm-up request itself is not learned


def test_calibration_paces_a_second_prompt_to_learn_the_shapes_the_first_compiled(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cost model skips each pass shape's first run (its compile) and a
    prompt's admitting step, so one paced prompt of a few large chunks (a
    GPU's) taught it one or two passes beside decode rows (session 41). The
    calibration paces two prompts of fresh tokens (no prefix to share), each
    prefilled to its end beside the decoding requests."""
    added: list[Add] = []
    cut_off: list[str] = []  # what the calibration's final abort found still running
    # 256-token prompts, which this CPU prefills within the budget
    config = SchedulerConfig(max_batch=32, prefill_batch=8, prefill_chunk=256)
    core = EngineCore(runner, config, memory_budget_bytes=8 << 30, prefix_cache_bytes=64 << 20)
    add, abort = core.add, core.abort
    monkeypatch.setattr(core, "add", lambda a: (added.append(a), add(a))[1])

    def aborting(ids: list[str]) -> None:
        cut_off.extend(i for i in ids if i in core.requests)
        abort(ids)

    monkeypatch.setattr(core, "abort", aborting)
    core.warmup(calibrate_s=2.0)
    paced = [a for a in added if a.request_id.startswith("__calibrate_prefill")]
    assert len(paced) == 2 and paced[0].prompt[:8] != paced[1].prompt[:8]
    # each finished (its one token after the whole prompt), the decoders did not
    assert not {a.request_id for a in paced} & set(cut_off), cut_off
    assert any(i.startswith("__calibrate_decode") for i in cut_off)
    assert_drained(core)


def test_warmup_samples_and_retires_a_row_from_between_decoding_ones(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside two greedy requests, the warm-up runs one that samples (top-p, a
    seed, a logit bias) and finishes first, from the middle of the batch, so
    the kernels those need and a row's leaving the batch are compiled before
    a user's request meets them (on CUDA each costs seconds the first time)."""
    from worker import core as core_module

    finished: list[tuple[str, int]] = []
    plain = core_module.EngineCore._retire

    def spy(self: EngineCore, req: Any, reason: str) -> None:
        finished.append((req.msg.request_id, len(self.requests)))
        plain(self, req, reason)

    monkeypatch.setattr(core_module.EngineCore, "_retire", spy)
    kept: list[list[int]] = []
    rows = batch_padding._rows
    monkeypatch.setattr(
        batch_padding, "_rows", lambda keep: (kept.append(list(keep)), rows(keep))[1]
    )
    added: list[Add] = []
    core = make_core(runner)
    add = core.add
    monkeypatch.setattr(core, "add", lambda a: (added.append(a), add(a))[1])
    core.warmup(calibrate_s=0)
    sampled = [a for a in added if a.sampling.temperature > 0]
    assert sampled and sampled[0].sampling.top_p < 1 and sampled[0].sampling.logit_bias
    assert sampled[0].sampling.seed is not None
    # it left the batch while the two greedy requests still decoded, from
    # between them: the rows that stayed were gathered by an index array
    assert finished[0][0] == sampled[0].request_id and finished[0][1] == 3
    assert [0, 2] in kept
    assert_drained(core)


def test_calibration_times_each_pass_in_its_own_step(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up's calibration waits for every prompt pass in the step that ran
    it (worker/calibrate.py: queued, a pass's device time lands in the next
    step and the fit misreads it); serving queues them again afterwards, and
    the tokens are the same either way."""
    from worker.fused import FusedGenerator

    seen: list[bool] = []
    real = FusedGenerator._queue

    def queue(self: FusedGenerator, *arrays: object) -> None:
        seen.append(self.timed_passes)
        real(self, *arrays)

    import worker.calibrate as calibrate

    during: list[bool] = []
    real_calibrate = calibrate._calibrate

    def calibrating(core: EngineCore, budget_s: float) -> dict[str, object]:
        seen.clear()  # the warm-up's own request before it is serving's
        out = real_calibrate(core, budget_s)
        during.extend(seen)
        return out

    monkeypatch.setattr(FusedGenerator, "_queue", queue)
    monkeypatch.setattr(calibrate, "_calibrate", calibrating)
    core = make_core(runner)
    core.warmup(calibrate_s=0.3)
    assert during and all(during), "a calibration pass was queued, not timed"
    assert runner.timed_passes is False
    seen.clear()
    prompts = {f"q{i}": prompt_of(300 + 40 * i, salt=i) for i in range(3)}
    for rid, p in prompts.items():
        core.add(Add(rid, p, 6, GREEDY))
    queued = {rid: tokens_of(o) for rid, o in run_to_completion(core).items()}
    assert seen and not any(seen)
    runner.timed_passes = True
    try:
        for rid, p in prompts.items():
            core.add(Add(rid, p, 6, GREEDY))
        timed = {rid: tokens_of(o) for rid, o in run_to_completion(core).items()}
    finally:
        runner.timed_passes = False
    assert timed == queued and all(len(t) == 6 for t in timed.values())


def test_idle_prefill_runs_at_full_chunk(runner: Runner) -> None:
    core = make_core(runner)
    core.add(Add("solo", prompt_of(1500), 2, GREEDY))
    out = core.step()
    # the whole prompt in one step, its last token too, and the first token
    # sampled from that pass (worker/fused.py, chunk start)
    assert core.step_log[-1][3] == 1500
    assert out is not None and [(o.request_id, len(o.token_ids)) for o in out.outputs] == [
        ("solo", 1)
    ]
    run_to_completion(core)
    assert_drained(core)


# -- prefix cache -------------------------------------------------------------------


def test_shared_prefix_is_reused_and_output_matches_cold(runner: Runner) -> None:
    shared = prompt_of(1000, 5)
    first = shared + prompt_of(20, 6)
    second = shared + prompt_of(30, 7)

    cold = make_core(runner, prefix_cache_bytes=0)
    cold.add(Add("c", second, 10, GREEDY))
    cold_tokens = tokens_of(run_to_completion(cold)["c"])
    cold_prefill = cold.counters.prompt_tokens

    core = make_core(runner)
    core.add(Add("a", first, 10, GREEDY))
    run_to_completion(core)
    before = core.counters.prompt_tokens
    core.add(Add("b", second, 10, GREEDY))
    outs = run_to_completion(core)["b"]
    assert outs[0].cached_tokens >= 1000
    assert tokens_of(outs) == cold_tokens
    processed = core.counters.prompt_tokens - before
    assert processed <= cold_prefill - 1000
    snap = core.prefix_cache.snapshot()
    assert snap["hits"] == 1 and snap["reused_tokens"] >= 1000
    assert_drained(core)


def test_a_finished_requests_state_is_kept_after_its_outputs_leave(runner: Runner) -> None:
    """The step that finishes a request returns before its state is evaluated
    into the prefix cache (worker/prefix_cache.py); the next step adds it, and a
    prompt that arrives in between still finds it."""
    core = make_core(runner)
    prompt = prompt_of(200, 9)
    core.add(Add("a", prompt, 3, GREEDY))
    finished = False
    while not finished:
        out = core.step()
        finished = out is not None and any(o.finish_reason for o in out.outputs)
    assert core.prefix_cache.queued and core.has_work() and core.needs_step()
    core.add(Add("b", prompt + prompt_of(20, 10), 2, GREEDY))
    outs = run_to_completion(core)["b"]
    assert outs[0].cached_tokens >= 200
    assert not core.prefix_cache.queued and not core.has_work()
    assert core.prefix_cache.snapshot()["inserts"] == 2
    assert_drained(core)


def test_an_abort_is_confirmed_before_its_row_leaves_the_batch(runner: Runner) -> None:
    """Removing a row waits for the step already queued on the device, so the
    confirmation goes first; the row and its kept state follow at the next step,
    which produces no token for it."""
    core = make_core(runner)
    core.add(Add("a", prompt_of(200, 11), 50, GREEDY))
    while core.runner.decoding == 0:
        core.step()
    core.abort(["a"])
    confirmed = core.take_pending()
    assert confirmed is not None and confirmed.outputs[0].finish_reason == "abort"
    assert core.runner.active == 1 and core.has_work() and core.needs_step()
    assert core.step() is None  # drops the row and keeps its state; nothing to report
    assert core.runner.active == 0 and not core.has_work()
    assert core.prefix_cache.snapshot()["inserts"] == 1
    assert_drained(core)


def test_exact_hit_leaves_one_token_to_process(runner: Runner) -> None:
    core = make_core(runner)
    prompt = prompt_of(300, 8)
    core.add(Add("a", prompt, 1, GREEDY))
    first = tokens_of(run_to_completion(core)["a"])
    # The finished request's cache covers prompt + its one token; ask for exactly that.
    again = prompt + first
    cold = make_core(runner, prefix_cache_bytes=0)
    cold.add(Add("c", again, 6, GREEDY))
    expected = tokens_of(run_to_completion(cold)["c"])
    core.add(Add("b", again, 6, GREEDY))
    outs = run_to_completion(core)["b"]
    assert outs[0].cached_tokens == len(again) - 1
    assert tokens_of(outs) == expected
    assert_drained(core)


def test_prefix_lookup_reuses_what_mlx_lm_would_without_its_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """worker/prefix_cache.py's own lookup: the same entry and length as mlx-lm's
    fetch_nearest_cache for a shorter, a longer and an exact match, the same
    KV values, a private copy, and never mlx-lm's O(L^2) trie search."""
    from mlx_lm.models.cache import KVCache, LRUPromptCache, PromptTrie

    from worker.prefix_cache import PrefixCache

    def state(tokens: list[int]) -> list[KVCache]:
        layers = []
        for i in range(2):
            c = KVCache()
            k = mx.array([[[[float(t + i)] * 4 for t in tokens]]])  # (1, 1, L, 4)
            c.update_and_fetch(k, -k)
            layers.append(c)
        return layers

    base = [5, 6, 7]
    entries = [base + list(range(100, 140)), base + [9] * 10]
    prompts = {
        "longer": [*base, 100, 101, 50, 51],  # shares 5 tokens with the first entry
        "shorter": base + [9] * 10 + [1, 2],  # extends the second entry
        "exact": base + [9] * 10,
        "prefix of an entry": [*base, 100],
    }
    ours = PrefixCache("m", 1 << 30)
    theirs = LRUPromptCache(max_size=16)
    for tokens in entries:
        ours.insert(tokens, state(tokens))
        theirs.insert_cache("m", tokens, state(tokens))
    ours.flush()
    expected = {}
    for name, prompt in prompts.items():
        cache, rest = theirs.fetch_nearest_cache("m", prompt)
        if not rest:  # the exact-hit guard: one token left to process
            for c in cache:
                c.trim(1)
            rest = prompt[-1:]
        expected[name] = (cache, len(prompt) - len(rest))

    def refused(*args: object) -> None:
        raise AssertionError("mlx-lm's trie search ran")

    monkeypatch.setattr(PromptTrie, "search", refused)
    for name, prompt in prompts.items():
        cache, reused = ours.lookup(prompt)
        want, want_reused = expected[name]
        assert cache is not None and reused == want_reused, name
        for got, ref in zip(cache, want, strict=True):
            assert got.offset == ref.offset == reused, name
            k, v, rk, rv = got.keys, got.values, ref.keys, ref.values
            assert mx.array_equal(k[..., :reused, :], rk[..., :reused, :]), name
            assert mx.array_equal(v[..., :reused, :], rv[..., :reused, :]), name
        # A row writes its own tokens after the reused ones: the entry stays as it was.
        for c in cache:
            c.update_and_fetch(mx.ones((1, 1, 3, 4)) * 1e4, mx.ones((1, 1, 3, 4)) * 1e4)
    again, _ = ours.lookup(prompts["longer"])
    assert again is not None and float(again[0].keys.max()) < 1e4
    assert ours.lookup([1, 2, 3]) == (None, 0)
    assert ours.stats.hits == 5 and ours.stats.lookups == 6


def test_prefix_cache_stays_within_its_byte_budget(runner: Runner) -> None:
    budget = 2 * 300 * runner.info.kv_bytes_per_token
    core = make_core(runner, prefix_cache_bytes=budget)
    for i in range(12):
        core.add(Add(f"p{i}", prompt_of(200, 100 + i), 2, GREEDY))
        run_to_completion(core)
        assert core.prefix_cache.nbytes <= budget
    snap = core.prefix_cache.snapshot()
    assert snap["evictions"] > 0 and snap["entries"] >= 1
    assert_drained(core)


# -- memory governor ----------------------------------------------------------------


def test_governor_defers_instead_of_failing(runner: Runner) -> None:
    per_request = (20 + 40) * runner.info.kv_bytes_per_token
    core = make_core(runner, kv_budget_bytes=int(3.5 * per_request), prefix_cache_bytes=0)
    for i in range(10):
        core.add(Add(f"g{i}", prompt_of(20, i), 40, GREEDY))
    most = 0
    outs: dict[str, list] = {}
    while core.has_work():
        step = core.step()
        most = max(most, core.stats()["active"])
        if step:
            for o in step.outputs:
                outs.setdefault(o.request_id, []).append(o)
    assert most == 3
    assert sorted(outs) == sorted(f"g{i}" for i in range(10))
    assert all(o[-1].finish_reason in ("length", "stop") for o in outs.values())
    assert core.governor.deferrals > 0
    assert_drained(core)


def test_request_that_can_never_fit_is_rejected(runner: Runner) -> None:
    core = make_core(runner, kv_budget_bytes=100 * runner.info.kv_bytes_per_token)
    core.add(Add("big", prompt_of(50), 60, GREEDY))
    step = core.step()
    assert step is not None and step.outputs[0].finish_reason == "rejected"
    assert "budget" in step.outputs[0].error


def test_a_burst_is_prefilled_in_passes_the_memory_left_can_hold(runner: Runner) -> None:
    """The governor learns each pass's scratch per prompt token (on CUDA a
    2,048-token pass of the 8B shape held 12-22 GB); with memory for about
    one 512-token pass beside the reservations, a burst of four 300-token
    prompts is prefilled in passes of at most that many tokens instead of one
    1,200-token pass, and every request still completes, greedy-identical."""
    alone = make_core(runner)
    for i in range(4):
        alone.add(Add(f"a{i}", prompt_of(300, i), 4, GREEDY))
    want = {rid: tokens_of(o) for rid, o in run_to_completion(alone).items()}
    assert max(s[3] for s in alone.step_log) > 512  # unbounded: one big pass

    core = make_core(runner)
    gov = core.governor
    room = gov.config.budget_bytes - gov.weights - gov.scratch_floor
    gov.scratch_rates[512] = room // 600  # taught: the room holds about 600 tokens
    for i in range(4):
        core.add(Add(f"a{i}", prompt_of(300, i), 4, GREEDY))
    assert not gov.pass_fits(1200, 300, core.prefix_cache.nbytes)
    got = {rid: tokens_of(o) for rid, o in run_to_completion(core).items()}
    assert got == want and len(got) == 4
    passes = [s[3] for s in core.step_log if s[3]]
    assert max(passes) <= 600 and sum(passes) == 1200
    assert_drained(core)


def test_calibration_warms_only_the_buckets_whose_scratch_fits(runner: Runner) -> None:
    """The calibration forces each chunk bucket past the planner (which cuts
    passes to memory); it stops at the first bucket whose pass over as many
    cached tokens the governor says would not fit (on the H200 the 8B shape's
    2,048-token one held 12 GB), so a smaller GPU's warm-up cannot run out of
    memory there. Taught: a pass reaching 1,024 tokens holds about a
    thousandth of the free memory per token, so the 512-token bucket's passes
    fit and the 1,024-token bucket's second (reaching 2,048) does not."""
    from worker.calibrate import calibrate

    core = make_core(runner, pacing=False, chunk_buckets=(16, 512, 1024))
    gov = core.governor
    room = gov.config.budget_bytes - gov.weights
    gov.scratch_rates[1024] = room // 1000
    assert gov.pass_fits(512, 1024, 0) and not gov.pass_fits(1024, 2048, 0)
    out = calibrate(core, 60.0)
    assert out["warm_buckets"] == [16, 512]
    assert gov.peak_scratch > 0  # its passes ran (none was turned away)
    assert_drained(core)


def test_governor_terms_add_up(runner: Runner) -> None:
    core = make_core(runner)
    for i in range(3):
        core.add(Add(f"t{i}", prompt_of(40, i), 50, GREEDY))
    for _ in range(5):
        core.step()
    t = core.stats()["governor"]
    parts = ("weights", "live_state", "reserved_growth", "prefix_cache", "temporary", "other")
    assert t["total"] == sum(t[p] for p in parts)
    assert t["headroom"] == t["budget"] - t["total"]
    assert t["live_state"] > 0 and t["reserved_requests"] == 3
    assert t["weights"] > 0
    run_to_completion(core)
    assert_drained(core)


# -- sampling ----------------------------------------------------------------------


def test_seeded_request_is_identical_alone_and_in_a_batch_of_16(runner: Runner) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=4242)
    core = make_core(runner)
    core.add(Add("alone", prompt_of(12, 1), 16, seeded))
    alone = tokens_of(run_to_completion(core)["alone"])
    core.add(Add("x0", prompt_of(30, 2), 16, GREEDY))
    core.step()
    core.add(Add("seeded", prompt_of(12, 1), 16, seeded))
    for i in range(1, 15):
        params = SamplingParams(temperature=0.8, seed=i) if i % 3 else GREEDY
        core.add(Add(f"x{i}", prompt_of(8 + i, 3 + i), 16, params))
    outs = run_to_completion(core)
    assert tokens_of(outs["seeded"]) == alone
    assert_drained(core)


def test_logprobs_match_log_softmax_of_the_model(runner: Runner) -> None:
    core = make_core(runner)
    prompt = prompt_of(24, 9)
    core.add(Add("lp", prompt, 3, GREEDY, logprobs=True, top_logprobs=5))
    outs = run_to_completion(core)["lp"]
    ids = tokens_of(outs)
    logits = runner.model(mx.array([prompt + ids[:-1]]))[0].astype(mx.float32)
    ref = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for k, out in enumerate(outs):
        row = ref[len(prompt) - 1 + k]
        assert out.logprobs is not None and out.top_logprobs is not None
        assert out.logprobs[0] == pytest.approx(row[ids[k]].item(), abs=1e-4)
        for tid, lp in out.top_logprobs[0]:
            assert lp == pytest.approx(row[int(tid)].item(), abs=1e-4)
        best = mx.argsort(-row)[:5].tolist()
        assert [int(t) for t, _ in out.top_logprobs[0]] == best
    assert_drained(core)


def test_penalties_and_logit_bias_change_greedy_output(runner: Runner) -> None:
    core = make_core(runner)
    prompt = prompt_of(10, 4)
    core.add(Add("plain", prompt, 8, GREEDY))
    plain = tokens_of(run_to_completion(core)["plain"])
    banned = SamplingParams(temperature=0.0, logit_bias={str(plain[0]): -100.0})
    core.add(Add("bias", prompt, 8, banned))
    assert tokens_of(run_to_completion(core)["bias"])[0] != plain[0]
    forced = SamplingParams(temperature=0.0, logit_bias={"77": 100.0}, repetition_penalty=1.0)
    core.add(Add("force", prompt, 4, forced))
    assert tokens_of(run_to_completion(core)["force"]) == [77] * 4
    rep = SamplingParams(temperature=0.0, logit_bias={"77": 5.0}, frequency_penalty=2.0)
    core.add(Add("freq", prompt, 6, rep))
    assert tokens_of(run_to_completion(core)["freq"]).count(77) < 6
    assert_drained(core)


def _known_costs(core: EngineCore, decode_s: float = 0.010) -> None:
    """Give the scheduler a cost model and decode step it did not have to time,
    so what it admits does not depend on this machine's speed."""
    model = CostModel()
    for tokens in (16, 64, 256, 1024):  # 1 ms + 20 us per token
        for _ in range(2):  # a shape's first pass is not learned
            model.observe(tokens, 0, tokens, 0.001 + 2e-5 * tokens)
    core.scheduler.cost = model
    core.scheduler.largest_paced = 1024  # and paced passes that large have run
    core._learn = False  # keep it: the real steps below must not refit it
    for _ in range(10):
        core.scheduler.observe_step(decode_s, decoding=2, prompt_tokens=0)


def _settle_streams(core: EngineCore, n: int) -> None:
    """Step until `n` rows are streams pacing protects (settle_tokens or more)."""
    while core.streams() < n:
        core.step()


def test_a_burst_beside_streams_leaves_the_bound_on_a_paced_pass(tiny_model_dir: Path) -> None:
    """Only the passes the planner paced lift `largest_paced` (worker/scheduler.py):
    eight prompts arriving beside four streams are a burst, prefilled unpaced,
    so the next lone prompt is still paced within the bound the paced passes
    set, not twice the burst's tokens. Fused steps: the engine learns only
    from steps of one pass (two passes teach neither estimate)."""
    fused = Runner(tiny_model_dir, max_batch=32, prefill_batch=8, prefill_chunk=2048, fused=True)
    core = make_core(fused)
    for i in range(4):
        core.add(Add(f"s{i}", prompt_of(8, i), 400, GREEDY))
    _settle_streams(core, 4)
    for _ in range(8):  # decode steps: the estimate a pass beside them is priced against
        core.step()
    assert core.scheduler.decode_step_s.value is not None
    bound = core.scheduler.largest_paced
    for i in range(8):
        core.add(Add(f"burst{i}", prompt_of(200, 20 + i), 2, GREEDY))
    steps = core.counters.prompt_tokens
    while any(r.startswith("burst") for r in core.requests):
        core.step()
    assert core.counters.prompt_tokens - steps >= 8 * 200  # prefilled beside the streams
    assert core.runner.decoding >= 4
    assert core.runner.fused_steps > 0
    assert core.scheduler.largest_paced == bound
    core.abort_all()
    while core.has_work():
        core.step()


def test_a_wave_that_arrives_over_several_steps_is_one_burst(runner: Runner) -> None:
    """A wave of requests reaches the worker over several steps (the gateway
    tokenizes them one by one): its first rows decode while the rest still
    wait. Those young rows (at most their first token) are part of the
    burst, not streams to pace it for; once they have settle_tokens, they are."""
    core = make_core(runner)
    for i in range(5):
        core.add(Add(f"first{i}", prompt_of(8, i), 200, GREEDY))
    while core.runner.decoding < 5:
        core.step()
    _known_costs(core)
    for i in range(3):
        core.add(Add(f"rest{i}", prompt_of(300, 10 + i), 4, GREEDY))
    assert core.streams() == 0  # five rows decode, none past its first token
    plan = core.plan_step()
    assert len(plan.admit) == 3 and plan.chunk == 2048  # the idle plan: all at once
    core.step(plan, planned=True)
    assert all(core.requests[f"rest{i}"].remaining == 0 for i in range(3))
    run_to_completion_of(core, [f"rest{i}" for i in range(3)])

    _settle_streams(core, 5)
    for i in range(3):  # the same newcomers beside five settled streams: paced
        core.add(Add(f"late{i}", prompt_of(300, 20 + i), 4, GREEDY))
    assert core.scheduler.paced(core.streams(), 3)
    assert core.plan_step().chunk < 300
    core.abort_all()
    core.step()
    assert_drained(core)


def test_a_wave_admitted_over_several_steps_stays_a_burst_to_its_end(runner: Runner) -> None:
    """A wave of 32 arriving at once enters `prefill_batch` (8) prompts per
    step. Its first rows settle (two tokens) while the rest still wait; they
    entered the batch after those arrived, so they are the same burst, not
    streams to pace the wave's tail for: every step admits 8 at the idle
    chunk, as mlx-lm's BatchGenerator does (on the H200 pacing the tail of a
    wave of 64 cost the engine 40% of the ceiling's throughput)."""
    core = make_core(runner)
    _known_costs(core)  # a paced step's budget would fit one 300-token prompt
    ids = [f"w{i}" for i in range(32)]
    for i, rid in enumerate(ids):
        core.add(Add(rid, prompt_of(300, i), 50, GREEDY))
    for step in range(4):
        plan = core.plan_step()
        assert [rid for rid, _ in plan.admit] == ids[8 * step : 8 * step + 8], step
        assert plan.chunk == 2048, step
        core.step(plan, planned=True)
        if step < 3:  # with prompts still waiting, no row is a stream
            assert core.streams() == 0
    core.step()  # the last rows' second token
    assert core.streams() == 32  # the wave in and settled: pacing now protects it
    assert max(core.requests[rid].generated for rid in ids) >= 3  # the first rows settled
    assert all(core.requests[rid].remaining == 0 for rid in ids)
    core.abort_all()
    core.step()
    assert_drained(core)


def run_to_completion_of(core: EngineCore, request_ids: list[str]) -> None:
    while any(rid in core.requests for rid in request_ids):
        core.step()


def test_a_burst_is_admitted_several_prompts_per_step(runner: Runner) -> None:
    core = make_core(runner)
    for i in range(5):  # more streams than newcomers: the step is paced
        core.add(Add(f"d{i}", prompt_of(8, i), 200, GREEDY))
    _settle_streams(core, 5)
    _known_costs(core)
    for i in range(3):
        core.add(Add(f"s{i}", prompt_of(20, 10 + i), 4, GREEDY))
    core.add(Add("long", prompt_of(3000, 20), 4, GREEDY))
    plan = core.plan_step()
    assert core.scheduler.paced(core.runner.decoding, 4)
    # all four join one step: the short prompts whole, the long one's first
    # chunk, padded to one chunk length within the 10 ms budget
    assert [rid for rid, _ in plan.admit] == ["s0", "s1", "s2", "long"]
    assert plan.chunk == 64
    core.step(plan, planned=True)
    assert core.step_log[-1][3] == 3 * 20 + 64  # every admitted row made progress
    short = [core.requests[f"s{i}"] for i in range(3)]
    assert all(r.remaining == 0 for r in short)
    assert core.requests["long"].remaining == 3000 - 64
    core.abort_all()
    core.step()
    assert_drained(core)


def test_an_abort_inside_a_multi_chunk_prefill_retires_at_once(runner: Runner) -> None:
    core = EngineCore(
        runner,
        SchedulerConfig(max_batch=8, prefill_batch=8, prefill_chunk=256),
        memory_budget_bytes=8 << 30,
    )
    core.add(Add("long", prompt_of(3000, 3), 4, GREEDY))
    core.step()
    assert core.step_log[-1][3] == 256  # one chunk of many
    core.abort(["long"])
    pending = core.take_pending()  # what the worker sends before any further step
    assert pending is not None and [o.finish_reason for o in pending.outputs] == ["abort"]
    steps = core.counters.steps
    assert core.step() is None and core.counters.steps == steps  # no rest-of-prompt step
    assert_drained(core)


def test_idle_worker_returns_mlx_buffer_cache(runner: Runner) -> None:
    core = make_core(runner, prefix_cache_bytes=0)
    for i in range(4):
        core.add(Add(f"c{i}", prompt_of(64, i), 16, GREEDY))
    run_to_completion(core)
    # mlx-lm's per-chunk clear_cache is disabled while requests run, and the
    # batch's buffers stay cached when it empties: a request that follows at once
    # reuses them. The worker releases them once it has been idle a while.
    assert mx.get_cache_memory() > 0
    core.add(Add("next", prompt_of(64, 9), 4, GREEDY))
    assert not core.release_idle_buffers()  # a request runs: nothing is released
    run_to_completion(core)
    assert core.release_idle_buffers()
    assert mx.get_cache_memory() == 0
    assert not core.release_idle_buffers()  # once per idle spell
    assert_drained(core)


def test_grammar_tokenizer_is_not_built_at_load() -> None:
    """llguidance's tokenizer build holds the GIL (minutes for a 152k-token random
    BPE): started at load it starved the loader (issue #12). It waits for the first
    grammar request."""
    import threading

    from worker.constraints import Constraints

    before = {t.ident for t in threading.enumerate()}
    Constraints(["a", "b", "c"], 3, (0,))
    started = [t.name for t in threading.enumerate() if t.ident not in before]
    assert "llg-tokenizer" not in started
