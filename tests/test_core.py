"""EngineCore in-process, on a real tiny model: no sockets, same semantics as the worker."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from protocol.messages import Add, RequestOutput, SamplingParams
from tests.worker_helpers import GREEDY, run_to_completion, tokens_of
from worker.core import EngineCore
from worker.runner import Runner
from worker.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> Runner:
    return Runner(tiny_model_dir, max_batch=16, prefill_batch=8, prefill_chunk=512)


@pytest.fixture
def core(runner: Runner) -> EngineCore:
    c = EngineCore(
        runner,
        SchedulerConfig(max_batch=16, prefill_batch=8, prefill_chunk=512),
        memory_budget_bytes=8 << 30,
    )
    yield c
    c.abort_all()
    c.step()
    assert runner.active == 0, "live batch rows leaked"


def solo(core: EngineCore, prompt: list[int], n: int) -> list[int]:
    core.add(Add("solo", prompt, n, GREEDY))
    return tokens_of(run_to_completion(core)["solo"])


def test_generates_max_tokens_with_one_terminal_output(core: EngineCore, runner: Runner) -> None:
    # Random weights may pick EOS at any time; a logit bias rules it out here.
    no_eos = SamplingParams(
        temperature=0.0, logit_bias={str(t): -100.0 for t in runner.info.eos_token_ids}
    )
    core.add(Add("a", [1, 2, 3, 4, 5], 7, no_eos))
    outs = run_to_completion(core)["a"]
    assert len(tokens_of(outs)) == 7
    assert [o.finish_reason for o in outs].count("length") == 1
    assert outs[-1].finish_reason == "length"
    assert core.stats()["active"] == 0 and core.stats()["requests"] == 0


def test_each_step_yields_one_message_with_all_requests(core: EngineCore) -> None:
    for i in range(4):
        core.add(Add(f"r{i}", [10 + i, 20, 30], 5, GREEDY))
    multi = 0
    while core.has_work():
        step = core.step()
        if step is None:
            continue
        ids = [o.request_id for o in step.outputs]
        assert len(ids) == len(set(ids)), "a request appeared twice in one step"
        multi = max(multi, len(ids))
    assert multi == 4


def test_batched_greedy_equals_solo(core: EngineCore) -> None:
    prompts = [[5 + i, 17, 33 + 2 * i, 9] * (i + 1) for i in range(6)]
    alone = [solo(core, p, 12) for p in prompts]
    for i, p in enumerate(prompts):
        core.add(Add(f"b{i}", p, 12, GREEDY))
    outs = run_to_completion(core)
    assert [tokens_of(outs[f"b{i}"]) for i in range(6)] == alone


def test_abort_frees_the_row_at_the_next_step(core: EngineCore, runner: Runner) -> None:
    core.add(Add("keep", [1, 2, 3], 30, GREEDY))
    core.add(Add("drop", [4, 5, 6], 30, GREEDY))
    for _ in range(4):
        core.step()
    assert runner.active == 2
    core.abort(["drop"])
    core.abort(["drop"])  # idempotent
    step = core.step()
    assert step is not None
    assert RequestOutput("drop", [], "abort") in step.outputs
    assert runner.active == 1
    outs = run_to_completion(core)
    assert "drop" not in outs and outs["keep"][-1].finish_reason in ("length", "stop")


def test_abort_of_a_waiting_request(core: EngineCore) -> None:
    core.add(Add("w", [1, 2], 3, GREEDY))
    core.abort(["w"])
    step = core.step()
    assert step is not None and step.outputs == [RequestOutput("w", [], "abort")]
    assert not core.has_work()


@pytest.mark.parametrize(
    ("add", "needle"),
    [
        (Add("e", [], 4, GREEDY), "empty"),
        (Add("e", [1], 0, GREEDY), "max_tokens"),
        (Add("e", [1] * 10, 10**6, GREEDY), "context length"),
        (Add("e", [10**7], 4, GREEDY), "token ids"),
        (Add("e", [1], 4, GREEDY, stop_token_ids=[-1]), "stop token"),
        (Add("e", [1], 4, SamplingParams(temperature=1.0, top_p=0.0)), "sampling"),
        (Add("e", [1], 4, GREEDY, top_logprobs=50), "top_logprobs"),
        (Add("e", [1], 4, SamplingParams(logit_bias={"9999999": 1.0})), "logit_bias"),
    ],
)
def test_invalid_requests_get_an_error_output_not_a_crash(
    core: EngineCore, add: Add, needle: str
) -> None:
    core.add(add)
    step = core.step()
    assert step is not None
    (out,) = step.outputs
    assert out.finish_reason == "rejected" and needle in out.error
    # the core still serves
    core.add(Add("ok", [1, 2], 2, GREEDY))
    assert len(tokens_of(run_to_completion(core)["ok"])) == 2


def test_stop_token_ids_end_the_request(core: EngineCore) -> None:
    first = solo(core, [7, 8, 9], 6)
    core.add(Add("s", [7, 8, 9], 6, GREEDY, stop_token_ids=[first[2]]))
    outs = run_to_completion(core)["s"]
    got = tokens_of(outs)
    assert got == first[: first.index(first[2]) + 1]
    assert outs[-1].finish_reason == "stop"


def test_logprobs_for_chosen_and_top_tokens(core: EngineCore) -> None:
    core.add(Add("lp", [3, 4, 5], 4, GREEDY, logprobs=True, top_logprobs=3))
    outs = run_to_completion(core)["lp"]
    for o in outs:
        assert o.logprobs is not None and o.top_logprobs is not None
        (lp,) = o.logprobs
        (top,) = o.top_logprobs
        assert len(top) == 3
        # greedy: the chosen token is the top-1 entry, with the same logprob
        assert int(top[0][0]) == o.token_ids[0]
        assert abs(top[0][1] - lp) < 1e-5
        assert top[0][1] >= top[1][1] >= top[2][1]
        assert lp <= 0.0


def test_seeded_sampling_is_independent_of_the_batch(core: EngineCore) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234)
    core.add(Add("alone", [11, 12, 13], 10, seeded))
    alone = tokens_of(run_to_completion(core)["alone"])
    core.add(Add("seeded", [11, 12, 13], 10, seeded))
    for i in range(6):
        core.add(Add(f"n{i}", [i + 1, 2, 3], 10, SamplingParams(temperature=1.0)))
    outs = run_to_completion(core)
    assert tokens_of(outs["seeded"]) == alone
    other = SamplingParams(temperature=1.0, seed=99)
    core.add(Add("other", [11, 12, 13], 10, other))
    assert tokens_of(run_to_completion(core)["other"]) != alone


def test_first_output_reports_queue_and_prefill_time(core: EngineCore) -> None:
    core.add(Add("t", [1, 2, 3, 4], 3, GREEDY))
    outs = run_to_completion(core)["t"]
    assert outs[0].prefill_s > 0.0 and outs[0].queued_s >= 0.0
    assert all(o.prefill_s == 0.0 and o.queued_s == 0.0 for o in outs[1:])


# -- containment (issue 13, findings 1, 4, 5, 8) ------------------------------------

NAN, INF = float("nan"), float("inf")
# Decodable Adds that must each be rejected without raising: every field at a value
# the gateway would refuse, so only the worker's own validation stands in the way.
POISON = {
    "5001-digit logit_bias key": SamplingParams(logit_bias={"9" * 5001: 1.0}),
    "superscript digit key": SamplingParams(logit_bias={"\u00b2": 1.0}),
    "arabic-indic digit key": SamplingParams(logit_bias={"\u0661": 1.0}),
    "negative key": SamplingParams(logit_bias={"-1": 1.0}),
    "empty key": SamplingParams(logit_bias={"": 1.0}),
    "nan bias": SamplingParams(logit_bias={"5": NAN}),
    "inf bias": SamplingParams(logit_bias={"5": INF}),
    "nan temperature": SamplingParams(temperature=NAN),
    "inf temperature": SamplingParams(temperature=INF),
    "nan penalty": SamplingParams(temperature=0.0, presence_penalty=NAN),
    "zero repetition penalty": SamplingParams(temperature=0.0, repetition_penalty=0.0),
    "negative top_k": SamplingParams(top_k=-1),
}


def _poison_adds() -> dict[str, Add]:
    adds = {name: Add("p", [1, 2], 4, s) for name, s in POISON.items()}
    adds["prompt id beyond int64"] = Add("p", [2**64 - 1], 4, GREEDY)
    adds["huge max_tokens"] = Add("p", [1], 2**63 - 1, GREEDY)
    adds["constraint nested 100k deep"] = Add("p", [1], 4, GREEDY, constraint="[" * 100_000)
    adds["constraint not json"] = Add("p", [1], 4, GREEDY, constraint="{")
    adds["reasoning ids beyond the vocabulary"] = Add(
        "p", [1], 4, GREEDY, constraint='{"reasoning": {"end": [99999999], "budget": 3}}'
    )
    return adds


@pytest.mark.parametrize("add", _poison_adds().values(), ids=_poison_adds().keys())
def test_poison_adds_are_rejected_while_others_continue(core: EngineCore, add: Add) -> None:
    core.add(Add("other", [4, 5, 6], 6, GREEDY))
    core.step()
    core.add(add)
    outs = run_to_completion(core)
    (out,) = outs["p"]
    assert out.finish_reason == "rejected" and out.error
    assert len(out.error) < 400  # bounded: never the 5,001 digits back
    assert outs["other"][-1].finish_reason in ("length", "stop")


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
BIG_ANYOF = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(5000)
    ]
}


@pytest.mark.parametrize("schema", [CYCLE, BIG_ANYOF], ids=["ref-cycle", "anyof-5000"])
def test_grammars_that_fail_at_their_start_are_rejected_not_stopped(
    core: EngineCore, schema: dict
) -> None:
    import json

    from gateway.serving.grammars import json_grammar

    core.add(Add("g", [1, 2], 8, GREEDY, constraint=json.dumps({"grammar": json_grammar(schema)})))
    (out,) = run_to_completion(core)["g"]
    assert out.finish_reason == "rejected" and "cannot be generated" in out.error, out


class _Raises:
    """A constraint whose processor raises at its n-th call (a bug in one request's code)."""

    failed = ""

    def __init__(self, n: int) -> None:
        self.calls, self.n = 0, n

    def __call__(self, context: object, logits: object) -> object:
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError("processor bug")
        return logits


class _Fails(_Raises):
    """A constraint that reports `failed` (a matcher error) and forces EOS, as ours do."""

    def __call__(self, context: object, logits: object) -> object:
        self.calls += 1
        if self.calls >= self.n:
            self.failed = "matcher error"
        return logits


@pytest.mark.parametrize("broken", [_Raises(3), _Fails(3)], ids=["raises", "fails"])
def test_a_failing_processor_retires_its_request_with_an_error_and_the_batch_goes_on(
    core: EngineCore, runner: Runner, monkeypatch: pytest.MonkeyPatch, broken: _Raises
) -> None:
    monkeypatch.setattr(runner.constraints, "make", lambda text: broken)
    no_eos = SamplingParams(temperature=0.0, logit_bias={"0": -100.0, "1": -100.0, "2": -100.0})
    core.add(Add("ok", [3, 4, 5], 12, no_eos))
    core.add(Add("bad", [3, 4, 5], 12, GREEDY, constraint='{"grammar": "x"}'))
    outs = run_to_completion(core)
    assert outs["bad"][-1].finish_reason == "error" and outs["bad"][-1].error
    assert [o.finish_reason for o in outs["bad"]].count("error") == 1
    assert len(tokens_of(outs["ok"])) == 12 and outs["ok"][-1].finish_reason == "length"
    assert core.stats()["finish_reasons"]["error"] == 1


def test_an_exception_at_insert_retires_only_that_request(
    core: EngineCore, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = runner.insert

    def insert(prompt: list[int], *args: object, **kw: object) -> int:
        if list(prompt) == [66, 67]:
            raise MemoryError("injected")
        return real(prompt, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "insert", insert)
    core.add(Add("ok", [3, 4, 5], 6, GREEDY))
    core.add(Add("bad", [66, 67], 6, GREEDY))
    outs = run_to_completion(core)
    assert outs["bad"] == [RequestOutput("bad", [], "error", error="MemoryError: injected")]
    assert outs["ok"][-1].finish_reason in ("length", "stop")


def _held_compiles(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Grammar compiles that wait until the test releases them (a compile in progress)."""
    release = threading.Event()
    real = runner.constraints.make

    def make(text: str) -> object:
        release.wait(60)
        return real(text)

    monkeypatch.setattr(runner.constraints, "make", make)
    return release


def test_compiling_grammars_do_not_hold_up_other_requests(
    core: EngineCore, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _held_compiles(runner, monkeypatch)
    grammar = '{"grammar": "start: \\"a\\"+"}'
    for i in range(4):
        core.add(Add(f"g{i}", [1, 2], 3, GREEDY, constraint=grammar))
    core.add(Add("plain", [7, 8], 5, GREEDY))
    outs: dict[str, list[RequestOutput]] = {}
    while "plain" not in outs or outs["plain"][-1].finish_reason is None:
        step = core.step()
        for o in step.outputs if step else []:
            outs.setdefault(o.request_id, []).append(o)
    assert core.stats()["compiling"] == 4 and not any(k.startswith("g") for k in outs)
    release.set()
    outs = run_to_completion(core)
    assert all(outs[f"g{i}"][-1].finish_reason in ("length", "stop") for i in range(4))


def test_compile_time_and_size_limits_reject(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.constraints import GrammarLimits

    c = EngineCore(
        runner,
        SchedulerConfig(max_batch=16, prefill_batch=8, prefill_chunk=512),
        memory_budget_bytes=8 << 30,
        grammar=GrammarLimits(threads=1, timeout_s=0.05, max_bytes=100),
    )
    try:
        c.add(Add("big", [1], 4, GREEDY, constraint='{"grammar": "' + "a" * 200 + '"}'))
        (out,) = run_to_completion(c)["big"]
        assert out.finish_reason == "rejected" and "grammar_max_bytes" in out.error
        release = _held_compiles(runner, monkeypatch)
        c.add(Add("slow", [1], 4, GREEDY, constraint='{"grammar": "start: \\"a\\""}'))
        (out,) = run_to_completion(c)["slow"]
        assert out.finish_reason == "rejected" and "to compile" in out.error
        release.set()
    finally:
        runner.constraints.configure(GrammarLimits())


def test_the_governor_sets_aside_a_modest_pass_and_fits_larger_ones_to_memory() -> None:
    """Pure: short passes and decode steps set the scratch floor; longer passes
    teach the scratch per prompt token of their span (furthest row end, in
    powers of two). Admission sets aside the floor plus a pass of
    `scratch_reserve_tokens`; a larger pass fits only while the memory the KV
    reservations leave holds it. A new high of scratch is reported."""
    from worker.governor import Governor, GovernorConfig

    cfg = GovernorConfig(budget_bytes=100_000, kv_bytes_per_token=1, scratch_reserve_tokens=100)
    gov = Governor(cfg, weights_bytes=40_000)
    assert gov.rate(100) is None and gov.pass_fits(10**9, 10**9, prefix_bytes=0)
    assert gov.observe_scratch(200, prompt_tokens=0, span=0) and gov.temporary == 200
    assert gov.observe_scratch(200 + 2 * 128, prompt_tokens=128, span=128)  # 2 per token
    assert gov.observe_scratch(200 + 8 * 1000, prompt_tokens=1000, span=1000)  # 8 at 1,024
    assert gov.scratch_rates == {128: 2, 1024: 8}
    assert (gov.rate(100), gov.rate(128), gov.rate(129), gov.rate(1024)) == (2, 2, 8, 8)
    assert gov.rate(4000) == 8 * 4  # beyond what was learnt: scaled by the span
    assert gov.temporary == 200 + 100 * 2  # a 100-token pass reaches at most 128
    assert not gov.observe_scratch(300, prompt_tokens=10, span=2000)  # the floor, no high
    assert gov.scratch_floor == 300 and gov.temporary == 300 + 200

    # 100,000 - 40,000 weights - 300 floor = 59,700 for scratch with nothing reserved.
    assert gov.pass_fits(7_000, 1024, prefix_bytes=0)  # 56,000
    assert not gov.pass_fits(8_000, 1024, prefix_bytes=0)  # 64,000
    assert gov.admit("a", 50_000, prefix_bytes=0) == (True, 0)
    assert gov.pass_fits(1_000, 1024, prefix_bytes=0)  # 8,000 of 9,700
    assert not gov.pass_fits(1_000, 1024, prefix_bytes=2_000)
    assert gov.pass_fits(100, 100, prefix_bytes=60_000)  # what admission set aside always fits
    # What admission has left: 100,000 - 40,000 - 500 set aside - 50,000 reserved.
    assert gov.admit("b", 9_501, prefix_bytes=0) == (False, 0)
    assert gov.admit("b", 9_500, prefix_bytes=0) == (True, 0)
    assert gov.terms(0, 0, 0, 0)["scratch_per_token"] == 2


def test_the_governor_sets_aside_a_smaller_pass_where_the_full_one_would_starve_kv() -> None:
    """Pure, at session 29's H100 numbers (llama8b, three targets on one GPU):
    a 23.9 GiB budget, 15 GiB of weights, 128 KiB of KV a token, and a
    448-token pass of span 256 that held 4,047 MiB of scratch. The 512-token
    pass at span 512 would take 9,251 MiB, more than the 8.9 GiB beside the
    weights, and every request was rejected; the set-aside is now a 256-token
    pass, so requests fit and a pass of that size still runs under a full KV
    load. A roomy budget (the H200's share) keeps the 512-token pass."""
    from worker.governor import Governor, GovernorConfig

    gib, mib = 1 << 30, 1 << 20
    weights = 15 * gib

    def taught(budget: int) -> Governor:
        gov = Governor(GovernorConfig(budget, kv_bytes_per_token=128 << 10), weights)
        gov.observe_scratch(40 * mib, prompt_tokens=0, span=0)
        gov.observe_scratch(40 * mib + 4047 * mib, prompt_tokens=448, span=256)
        return gov

    tight = taught(int(23.9 * gib))
    rate = tight.rate(512)
    assert rate is not None and 512 * rate > int(23.9 * gib) - weights  # the full pass
    assert tight.reserve_tokens == 256
    assert tight.temporary == 40 * mib + 256 * (tight.rate(256) or 0)
    assert tight.temporary - 40 * mib <= (int(23.9 * gib) - weights - 40 * mib) // 2
    assert tight.could_ever_fit(tight.need(131, 128))
    assert tight.admit("a", tight.need(2000, 2000), prefix_bytes=0) == (True, 0)
    assert tight.pass_fits(256, 256, prefix_bytes=0)
    assert tight.terms(0, 0, 0, 0)["scratch_reserve_tokens"] == 256

    roomy = taught(47 * gib)
    assert roomy.reserve_tokens == 512 and roomy.temporary == 40 * mib + 512 * (rate or 0)
    # What the worker logs at ready: a room below the whole context is named.
    from worker.governor import kv_room_warning

    assert kv_room_warning(roomy.kv_capacity(), 128 << 10, 8192) is None
    note = kv_room_warning(-175 * mib, 128 << 10, 8192)  # before the fix
    assert note is not None and "0.0 MiB for KV state, 0 tokens of the model's 8192" in note


def test_going_idle_takes_finished_requests_into_the_prefix_cache(runner: Runner) -> None:
    """EngineCore.idle (the worker calls it before it waits for work): a
    finished request's KV state enters the prefix cache then, not during the
    next request's lookup."""
    core = EngineCore(
        runner,
        SchedulerConfig(max_batch=16, prefill_batch=8, prefill_chunk=512),
        memory_budget_bytes=8 << 30,
        prefix_cache_bytes=64 << 20,
    )
    cache = core.prefix_cache
    assert cache.enabled and len(cache._lru) == 0
    core.add(Add("turn", list(range(3, 60)), 4, GREEDY))
    finished = False
    while not finished:  # the worker's steps, up to the one that ends the request
        step = core.step()
        finished = step is not None and any(o.finish_reason for o in step.outputs)
    assert len(cache._queued) == 1  # kept at the finish, added later
    core.idle()
    assert not cache._queued and len(cache._lru) == 1
    assert cache.flush() == 0  # nothing left for the next lookup to add
