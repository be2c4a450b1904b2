"""EngineCore in-process, on a real tiny model: no sockets, same semantics as the worker."""

from __future__ import annotations

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
