"""Unit tests of the scheduler's pure logic: admission order, the prefill cost
model and the per-step prefill budget (no MLX)."""

from collections.abc import Callable

import pytest

from worker.scheduler import (
    BATCH,
    INTERACTIVE,
    CostModel,
    Row,
    Scheduler,
    SchedulerConfig,
    pass_shape,
)


def test_fifo_within_priority_and_interactive_first() -> None:
    s: Scheduler[str] = Scheduler(SchedulerConfig())
    s.push("b1", "b1", BATCH)
    s.push("i1", "i1", INTERACTIVE)
    s.push("b2", "b2", BATCH)
    s.push("i2", "i2", INTERACTIVE)
    assert [s.pop() for _ in range(4)] == ["i1", "i2", "b1", "b2"]
    assert s.waiting() == 0


def test_remove_waiting_request() -> None:
    s: Scheduler[str] = Scheduler(SchedulerConfig())
    s.push("a", "A")
    s.push("b", "B")
    assert s.remove("a") == "A"
    assert s.remove("a") is None
    assert s.pop() == "B"


def test_prefill_slots_respect_batch_width() -> None:
    s: Scheduler[int] = Scheduler(SchedulerConfig(max_batch=4, prefill_batch=3))
    for i in range(10):
        s.push(str(i), i)
    assert s.prefill_slots(running=0, prefilling=0) == 3
    assert s.prefill_slots(running=3, prefilling=0) == 1  # batch room: 1
    assert s.prefill_slots(running=2, prefilling=2) == 1  # prefill width: 1
    assert s.prefill_slots(running=4, prefilling=0) == 0  # batch full
    assert s.head(2) == [0, 1] and s.waiting() == 10


def test_buckets_default_to_powers_of_two_up_to_the_chunk() -> None:
    assert SchedulerConfig(prefill_chunk=1000, min_chunk=16).buckets() == (
        16, 32, 64, 128, 256, 512, 1000,
    )  # fmt: skip
    cfg = SchedulerConfig(prefill_chunk=512, chunk_buckets=(1024, 64, 256))
    assert cfg.buckets() == (64, 256)  # above prefill_chunk: dropped


def _linear_costs(a: float, b: float, c: float = 0.0, d: float = 0.0) -> CostModel:
    """A model fed exact passes of a known cost curve a + b*T + c*T*K + d*T*L."""
    m = CostModel()
    for tokens, kv in [(16, 0), (64, 0), (256, 0), (1024, 0), (64, 512), (256, 256), (512, 1024)]:
        for _ in range(2):  # the first pass of a shape is not learned (a compile)
            m.observe(tokens, kv, tokens, a + b * tokens + c * tokens * kv + d * tokens * tokens)
    return m


def test_cost_model_recovers_a_known_curve() -> None:
    m = _linear_costs(0.002, 1e-5, 2e-8, 5e-9)
    assert m.ready
    for tokens, kv in [(32, 0), (128, 512), (2048, 0), (512, 2048)]:
        truth = 0.002 + 1e-5 * tokens + 2e-8 * tokens * kv + 5e-9 * tokens * tokens
        assert m.predict(tokens, kv, tokens) == pytest.approx(truth, rel=0.02)


def test_cost_model_learns_a_fixed_cost_for_passes_beside_decode_rows() -> None:
    """A fused step pays a pass's fixed cost once for its decode rows and its
    prompt chunk: the chunk beside decode rows costs less than alone, and the
    model keeps the two apart instead of averaging them (module doc)."""
    m = _linear_costs(0.010, 2e-5)  # alone: 10 ms + 20 us/token
    # Nothing beside decode rows learned yet: the lone pass's fixed cost.
    assert m.predict(256, 0, 256, beside=True) == pytest.approx(m.predict(256, 0, 256))
    for tokens in (64, 256, 512):
        for _ in range(3):  # the first pass of each shape beside decode rows is a compile
            m.observe(tokens, 0, tokens, 0.003 + 2e-5 * tokens, beside=True)
    assert m.predict(1024, 0, 1024) == pytest.approx(0.010 + 2e-5 * 1024, rel=0.02)
    assert m.predict(1024, 0, 1024, beside=True) == pytest.approx(0.003 + 2e-5 * 1024, rel=0.02)


def test_a_fixed_cost_resting_on_one_pass_borrows_the_other_kinds() -> None:
    """One pass beside decode rows that still paid for compiles (session 41's
    8B calibration: 56 ms where such passes took 8-9) does not set that kind's
    fixed cost: until three are learned, the lone passes' serves."""
    two = CostModel()
    for tokens in (64, 64, 256, 256):  # two learned, of two sizes: ready
        two.observe(tokens, 0, tokens, 0.010 + 2e-5 * tokens)
    # few passes alone, none beside: those still borrow (not a free pass)
    assert two.predict(512, 0, 512, beside=True) == pytest.approx(two.predict(512, 0, 512))
    m = _linear_costs(0.010, 2e-5)
    m.observe(256, 0, 256, 0.056, beside=True)  # the shape's first: a compile
    m.observe(256, 0, 256, 0.056, beside=True)  # learned, alone of its kind
    assert m.predict(512, 0, 512, beside=True) == pytest.approx(m.predict(512, 0, 512), rel=0.02)
    for tokens in (128, 512, 128, 512, 128):  # three learned (not the first of each size)
        m.observe(tokens, 0, tokens, 0.004 + 2e-5 * tokens, beside=True)
    # the kind's own fixed cost (the high pass dropped as missed by over 2x)
    assert m.predict(512, 0, 512, beside=True) == pytest.approx(0.004 + 2e-5 * 512, rel=0.05)


def test_a_paced_chunk_is_planned_by_the_fixed_cost_of_a_pass_beside_decode_rows() -> None:
    """Passes alone cost 8 ms + 20 us/token, beside decode rows 2 ms + 20
    us/token; the budget is 10 ms. By the lone passes' fixed cost only 128
    tokens fit (10.6 ms, within the widening to 1.25 x the smallest's 9.3);
    by what the paced steps measured, 256 do."""
    s = _paced(0.008, 2e-5, 0.010, pacing_factor=2.0, prefill_chunk=2048, min_chunk=64)
    assert s.plan_prefill(4, [Row(5000)], []) == (128, 0)
    # steps of decode (10 ms) + prompt chunk; each size's first is a compile
    for tokens in (64, 128, 64, 128, 64):
        shape = (tokens, 0, tokens)
        s.observe_step(0.010 + 0.002 + 2e-5 * tokens, decoding=4, prompt_tokens=tokens, shape=shape)
    assert s.plan_prefill(4, [Row(5000)], []) == (256, 0)  # 7.1 ms; 512: 12.2
    assert s.predicted_step_s(4, (256, 0, 256)) == pytest.approx(
        0.010 + 0.002 + 2e-5 * 256, rel=0.02
    )
    assert s.predicted_step_s(0, (256, 0, 256)) == pytest.approx(0.008 + 2e-5 * 256, rel=0.02)


def test_cost_model_needs_two_sizes_and_never_goes_negative() -> None:
    m = CostModel()
    assert not m.observe(64, 0, 64, 0.5)  # a shape's first pass: its compile, not learned
    m.observe(64, 0, 64, 0.01)
    m.observe(64, 0, 64, 0.012)
    assert not m.ready  # one size says nothing about the slope
    for tokens, seconds in ((128, 0.011), (256, 0.010)):  # noise: a negative slope
        m.observe(tokens, 0, tokens, seconds)
        m.observe(tokens, 0, tokens, seconds)
    assert all(c >= 0 for c in m.predict_coef())
    assert m.predict(4096, 4096, 4096) >= 0


def test_cost_model_is_ready_only_while_its_window_holds_two_sizes() -> None:
    m = CostModel(window=3)
    for tokens in (64, 64, 128, 128):  # each size's first pass is not learned
        m.observe(tokens, 0, tokens, 0.01)
    assert m.ready
    for _ in range(2):
        m.observe(128, 0, 128, 0.01)
    assert not m.ready  # the 64-token pass left the window
    m.observe(64, 0, 64, 0.01)
    assert m.ready


def test_cost_model_drops_a_first_use_outlier() -> None:
    m = _linear_costs(0.001, 1e-5)
    before = m.predict(512, 0, 512)
    assert not m.observe(512, 0, 512, 5.0)  # a compile, not the pass's cost
    assert m.predict(512, 0, 512) == pytest.approx(before)
    assert not m.observe(512, 0, 512, 5.0)
    assert m.observe(512, 0, 512, 5.0)  # three in a row: the machine really is slower


def _paced(a: float, b: float, decode_s: float, **cfg: object) -> Scheduler[int]:
    s: Scheduler[int] = Scheduler(SchedulerConfig(**cfg))  # type: ignore[arg-type]
    s.cost = _linear_costs(a, b)
    for _ in range(10):
        s.observe_step(decode_s, decoding=4, prompt_tokens=0)
    s.largest_paced = 1 << 20  # the model has seen every size (its reach: below)
    return s


def test_paced_chunk_is_the_largest_bucket_within_the_budget() -> None:
    # decode 10 ms, factor 2: 10 ms of prefill per step; a pass costs 1 ms + 20 us/token
    s = _paced(0.001, 2e-5, 0.010, pacing_factor=2.0, prefill_chunk=2048)
    assert s.prefill_budget_s() == pytest.approx(0.010)
    chunk, admit = s.plan_prefill(4, [Row(5000)], [])
    assert (chunk, admit) == (256, 0)  # 256 tokens: 6.1 ms; 512: 11.2 ms
    assert s.predicted_step_s(4, pass_shape([Row(5000)], chunk)) <= 2.0 * 0.010
    idle_chunk, _ = s.plan_prefill(0, [Row(5000)], [])
    assert idle_chunk == 2048  # idle: no pacing limit


def test_a_paced_pass_reaches_at_most_twice_the_largest_paced_pass_run() -> None:
    """A model that says every size is cheap (fitted on small passes) is trusted
    one doubling beyond the paced passes it has seen, so a 2,000-token prompt
    beside streams grows 64, 128, 256 ... instead of going in one pass."""
    s = _paced(0.001, 1e-7, 0.010, pacing_factor=2.0, prefill_chunk=2048, min_chunk=64)
    s.largest_paced = 0
    chunks = []
    for _ in range(4):
        chunk, _ = s.plan_prefill(16, [Row(2000)], [])
        chunks.append(chunk)
        s.observe_step(
            0.011, decoding=16, prompt_tokens=chunk, shape=(chunk, 0, chunk), paced=s.planned_paced
        )
    assert chunks == [64, 128, 256, 512]
    assert s.largest_paced == 512
    chunk, n = s.plan_prefill(16, [], [Row(900), Row(900), Row(900)])
    assert n == 2 and chunk == 512  # two rows of 512: 1,024 tokens, the reach
    assert s.plan_prefill(0, [Row(2000)], [])[0] == 2048  # idle: no pacing, no reach


def test_only_passes_the_planner_paced_lift_the_reach() -> None:
    """A burst admitted beside rows of its own wave is not paced: its 4,000
    tokens must not lift the bound on the next paced pass (session 42's 8B
    run: with the bound gone and a model pricing such passes by their KV
    alone, a prompt's last 1,227 tokens went in one 61-ms step)."""
    s = _paced(0.001, 1e-7, 0.010, pacing_factor=2.0, prefill_chunk=2048, min_chunk=64)
    s.largest_paced = 0
    chunk, n = s.plan_prefill(2, [], [Row(500)] * 8)  # 8 newcomers beside 2 streams
    assert not s.planned_paced and n == 8
    s.observe_step(0.05, 2, 4000, (4000, 0, chunk), admitted=n, paced=s.planned_paced)
    assert s.largest_paced == 0
    chunk, _ = s.plan_prefill(16, [Row(2000)], [])
    assert s.planned_paced and chunk == 64  # the smallest bucket, as before any paced pass
    s.observe_step(0.011, 16, 64, (64, 0, 64), paced=s.planned_paced)
    assert s.largest_paced == 64


def test_a_burst_is_admitted_several_prompts_per_step() -> None:
    s = _paced(0.001, 2e-5, 0.010, pacing_factor=2.0, prefill_batch=8)
    burst = [Row(60)] * 8  # 8 waiting 61-token prompts beside 12 streams
    chunk, admit = s.plan_prefill(12, [], burst)
    # 8 rows x 60 tokens = 480 tokens: 10.6 ms, over budget; 7 rows: 9.4 ms
    assert admit == 7 and chunk >= 60
    shape = pass_shape(burst[:admit], chunk)
    assert s.cost.predict(*shape) <= s.prefill_budget_s()  # type: ignore[operator]


def test_rows_already_prefilling_share_the_budget() -> None:
    s = _paced(0.001, 2e-5, 0.010, pacing_factor=2.0)
    chunk, admit = s.plan_prefill(4, [Row(3000, kv=512)], [Row(3000), Row(3000)])
    assert admit >= 1  # a long prompt does not hold the next one back
    rows = [Row(3000, kv=512)] + [Row(3000)] * admit
    assert s.cost.predict(*pass_shape(rows, chunk)) <= 0.010 + 1e-9


def test_a_fixed_cost_above_the_budget_widens_the_step_to_what_costs_the_same() -> None:
    """A GPU's 60 ms per pass over a 7 ms decode step: the smallest chunk stalls
    the streams as long as a large one, so the step carries a large one."""
    s = _paced(0.060, 1e-6, 0.007, pacing_factor=2.0)
    chunk, _ = s.plan_prefill(4, [Row(5000)], [])
    assert chunk >= 1024  # 1024 tokens cost 61 ms, under 1.25 x the smallest's 60 ms
    assert s.cost.predict(*pass_shape([Row(5000)], chunk)) <= 1.25 * 0.0601


def test_the_slack_sets_how_far_past_the_smallest_chunk_a_fixed_cost_widens_the_step() -> None:
    """A 10 ms fixed cost plus 10 us a token over a 7 ms decode step: the
    smallest chunk (64) costs 10.6 ms; a 1.25 slack allows 13.3 (256 tokens:
    12.6; 512: 15.1), a 2.0 slack 21.3 (1,024: 20.2; 2,048: 30.5)."""
    chunks = {}
    for slack in (1.25, 2.0):
        s = _paced(0.010, 1e-5, 0.007, pacing_factor=2.0, pacing_slack=slack, min_chunk=64)
        chunks[slack] = s.plan_prefill(4, [Row(5000)], [])[0]
    assert chunks == {1.25: 256, 2.0: 1024}


def test_newcomers_as_many_as_the_streams_are_planned_as_if_idle() -> None:
    """Pacing protects streams from a minority of newcomers; a burst at least as
    large as the decoding batch is admitted whole, at the idle chunk."""
    s = _paced(0.001, 2e-5, 0.010, pacing_factor=2.0, prefill_batch=8)
    assert s.plan_prefill(8, [], [Row(300)] * 8) == (2048, 8)
    assert s.plan_prefill(8, [Row(300)] * 4, [Row(300)] * 4) == (2048, 4)
    chunk, admit = s.plan_prefill(9, [], [Row(300)] * 8)  # streams outnumber them: paced
    assert chunk < 2048 and admit < 8
    assert not s.paced(8, 8) and s.paced(9, 8) and not s.paced(0, 0)
    assert s.paced(1, 1) and not s.paced(1, 2)  # one newcomer is never a burst


def test_idle_chunk_is_the_fastest_bucket_not_the_largest() -> None:
    """MLX's CPU attention makes one huge chunk slower than several smaller ones
    (a strong within-chunk term): the idle chunk follows the model."""
    s: Scheduler[int] = Scheduler(SchedulerConfig(prefill_chunk=2048))
    s.cost = _linear_costs(0.002, 1e-5, 1e-8, 5e-7)
    assert s.idle_chunk(2047) < 2048
    flat: Scheduler[int] = Scheduler(SchedulerConfig(prefill_chunk=2048))
    flat.cost = _linear_costs(0.050, 1e-6)  # fixed-cost bound: one pass is best
    assert flat.idle_chunk(2047) == 2048


def test_a_pass_is_cut_until_the_memory_governor_says_it_fits() -> None:
    """Idle, 8 prompts of 300 tokens would take one 2,400-token pass; a pass
    that does not fit loses newcomers first (they wait), then bucket size, and
    prefill never stops: one smallest pass runs whatever memory says."""
    s: Scheduler[int] = Scheduler(SchedulerConfig(prefill_chunk=2048, min_chunk=64))
    burst = [Row(300)] * 8
    asked: list[tuple[int, int]] = []

    def within(cap: int) -> Callable[[int, int], bool]:
        def fits(tokens: int, span: int) -> bool:
            asked.append((tokens, span))
            return tokens <= cap

        return fits

    assert s.plan_prefill(0, [], burst) == (2048, 8)
    assert s.plan_prefill(0, [], burst, fits=None) == (2048, 8)
    chunk, n = s.plan_prefill(0, [], burst, fits=within(1000))
    assert (chunk, n) == (2048, 3) and pass_shape(burst[:3], chunk)[0] <= 1000
    assert asked[-1] == (900, 300)  # span: the furthest row end
    # Rows already prefilling are not dropped: their bucket shrinks instead.
    prefilling = [Row(3000, kv=512)] * 4
    chunk, n = s.plan_prefill(0, prefilling, burst[:4], fits=within(1000))
    assert n == 0 and chunk == 128 and asked[-1] == (512, 640)
    assert s.plan_prefill(0, prefilling, [], fits=within(10)) == (64, 0)  # the floor
    assert s.plan_prefill(0, [], burst, fits=within(10)) == (64, 1)


def test_unfitted_model_paces_with_the_smallest_bucket_and_one_prompt() -> None:
    s: Scheduler[int] = Scheduler(SchedulerConfig(min_chunk=16))
    assert s.plan_prefill(4, [], [Row(100), Row(100)]) == (16, 1)
    assert s.plan_prefill(4, [Row(100)], [Row(100)]) == (16, 0)
    assert s.plan_prefill(0, [], [Row(100), Row(100)]) == (2048, 2)  # idle: all, full chunk
    assert Scheduler(SchedulerConfig(pacing=False)).plan_prefill(8, [], [Row(9)]) == (2048, 1)


def test_a_settled_model_refits_every_few_passes_not_at_every_one() -> None:
    """The fit runs on the engine thread between steps: once the model has
    `settled` passes, one new pass does not refit it, `refit_every` do."""
    m = CostModel(settled=8, refit_every=4)
    for tokens in (16, 64, 256, 1024) * 3:  # 12 passes (the first of each shape is skipped)
        m.observe(tokens, 0, tokens, 0.001 + 1e-5 * tokens)
    m.predict_coef()  # fitted on everything so far
    before = m.predict(512, 0, 512)
    assert before == pytest.approx(0.001 + 1e-5 * 512, rel=0.02)
    assert not m.observe(512, 0, 512, 1.0)  # this shape's first pass: never learned
    for _ in range(3):  # slower passes, not outliers (under 4x the prediction)
        assert m.observe(512, 0, 512, 2 * before)
        assert m.predict(512, 0, 512) == before  # not refitted yet
    assert m.observe(512, 0, 512, 2 * before)
    assert m.predict(512, 0, 512) > before  # the fourth refits
    m.observe(512, 0, 512, 2 * before)
    coef = m.predict_coef()  # what is reported is always fitted on everything
    assert m.predict(512, 0, 512) == pytest.approx(
        sum(c * x for c, x in zip(coef, (1, 0, 512, 0, 0, 512 * 512), strict=True))
    )


def test_an_admitting_paced_step_is_priced_with_what_admissions_cost() -> None:
    """Passes cost 1 ms + 20 us/token beside 4 decoding rows (10 ms steps), and a
    step that admits a prompt takes 4 ms more (session 31's traces: a row's
    first pass, its KV allocation, the prefix copy). With `admission_cost` the
    scheduler learns the 4 ms into a term of its own (not into the pass
    model), predicts it, and plans the admitting step one bucket smaller so
    that it stays within the 10 ms prefill budget. Off, the admitting steps
    teach the pass model, which then overprices every pass."""
    on = _paced(0.001, 2e-5, 0.010, pacing_factor=2.0, prefill_chunk=2048, admission_cost=True)
    off = _paced(0.001, 2e-5, 0.010, pacing_factor=2.0, prefill_chunk=2048, admission_cost=False)
    for s in (on, off):
        for tokens in (128, 256, 128, 256, 128):
            shape = (tokens, 0, tokens)
            s.observe_step(0.010 + 0.001 + 2e-5 * tokens + 0.004, 4, tokens, shape, admitted=1)
    assert on.admit_s() == pytest.approx(0.004, rel=0.01) and off.admit_s() == 0.0
    pass_256 = 0.010 + 0.001 + 2e-5 * 256
    assert on.predicted_step_s(4, (256, 0, 256)) == pytest.approx(pass_256, rel=0.01)
    assert on.predicted_step_s(4, (256, 0, 256), admitted=1) == pytest.approx(
        pass_256 + 0.004, rel=0.01
    )
    assert (
        off.predicted_step_s(4, (256, 0, 256)) > pass_256 + 0.001
    )  # the admissions, learnt as passes
    # 256 tokens: 6.1 ms of pass, plus 4 of admission: over the 10 ms budget
    assert on.plan_prefill(4, [], [Row(5000)]) == (128, 1)
    # a step that admits nothing is priced by its pass alone
    assert on.plan_prefill(4, [Row(5000)], []) == (256, 0)
