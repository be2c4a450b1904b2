"""A step that runs out of device memory, in-process on a real tiny model.

The failure is the one injected piece (worker/proc.fail_next_step, the same
hook the worker's fault utility uses): the step runs whole on the real model,
then raises what CUDA's allocator raises when the device is full, so the
generator's state has moved on and none of that step's tokens were reported.
Everything after it is the real engine: the recovery, the requeue, the
recomputed prompts, the governor's lowered budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.exit_codes import is_out_of_memory
from protocol.messages import Add, RequestOutput, SamplingParams
from tests.worker_helpers import GREEDY, run_to_completion, tokens_of
from worker.core import EngineCore
from worker.governor import Governor, GovernorConfig
from worker.proc import fail_next_step
from worker.runner import Runner
from worker.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> Runner:
    return Runner(tiny_model_dir, max_batch=16, prefill_batch=8, prefill_chunk=512)


def make_core(runner: Runner, budget: int = 8 << 30) -> EngineCore:
    return EngineCore(
        runner,
        SchedulerConfig(max_batch=16, prefill_batch=8, prefill_chunk=512),
        memory_budget_bytes=budget,
    )


@pytest.fixture
def core(runner: Runner) -> EngineCore:
    c = make_core(runner)
    yield c
    c.abort_all()
    c.step()
    assert runner.active == 0, "live batch rows leaked"


def no_eos(runner: Runner) -> SamplingParams:
    """Greedy, with EOS ruled out: every request runs to its max_tokens."""
    return SamplingParams(
        temperature=0.0, logit_bias={str(t): -100.0 for t in runner.info.eos_token_ids}
    )


PROMPTS = [[5 + i, 17, 33 + 2 * i, 9] * (i + 2) for i in range(4)]


def reference(runner: Runner, n: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from a core that never fails."""
    core = make_core(runner)
    for i, p in enumerate(PROMPTS):
        core.add(Add(f"r{i}", p, n, no_eos(runner)))
    return {rid: tokens_of(outs) for rid, outs in run_to_completion(core).items()}


def step_until(core: EngineCore, outs: dict[str, list[RequestOutput]], tokens: int) -> None:
    """Step until every running request has sent at least `tokens` tokens."""
    while not all(r.generated >= tokens for r in core.requests.values()):
        step = core.step()
        for o in step.outputs if step else []:
            outs.setdefault(o.request_id, []).append(o)


def test_the_out_of_memory_errors_are_recognised() -> None:
    assert is_out_of_memory(
        RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
    )
    assert is_out_of_memory(RuntimeError("[metal::malloc] Unable to allocate 1073741824 bytes"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shapes (1,4) and (5,4) cannot be broadcast"))


def test_the_budget_drops_below_what_the_failed_step_held_until_restored() -> None:
    g = Governor(GovernorConfig(budget_bytes=10_000, kv_bytes_per_token=10), weights_bytes=4_000)
    assert g.out_of_memory(held_bytes=7_000) == 4_000 + 2_700  # weights + 90% beside them
    assert g.kv_capacity() == 2_700
    assert g.out_of_memory(held_bytes=9_000) == 6_700, "a later failure never raises it"
    assert g.out_of_memory(held_bytes=3_000) == 4_000, "never below the weights"
    assert g.terms(0, 0, 4_000, 0)["budget"] == 4_000
    assert g.out_of_memory(held_bytes=3_000, keep=500) == 4_500, "room for the oldest request"
    assert g.restore() and g.budget == 10_000
    assert not g.restore()
    assert g.out_of_memory(held_bytes=3_000, keep=50_000) == 10_000, "never above the configured"


def test_running_requests_are_recomputed_and_their_greedy_output_is_unchanged(
    core: EngineCore, runner: Runner
) -> None:
    expected = reference(runner, 16)
    for i, p in enumerate(PROMPTS):
        core.add(Add(f"r{i}", p, 16, no_eos(runner)))
    outs: dict[str, list[RequestOutput]] = {}
    step_until(core, outs, 4)
    budget = core.governor.budget
    fail_next_step(runner)
    for rid, more in run_to_completion(core).items():
        outs.setdefault(rid, []).extend(more)

    assert {rid: tokens_of(o) for rid, o in outs.items()} == expected
    assert all([o.finish_reason for o in outs[rid]].count("length") == 1 for rid in expected)
    stats = core.stats()
    assert stats["out_of_memory_steps"] == 1
    assert "error" not in stats["finish_reasons"]
    assert core.governor.budget < budget
    # the first output alone reports the prefix-cache hit and the queue time
    assert all(sum(o.queued_s > 0 for o in outs[rid]) <= 1 for rid in expected)


def test_a_request_through_two_failed_steps_ends_with_an_error_and_the_rest_go_on(
    core: EngineCore, runner: Runner
) -> None:
    expected = reference(runner, 12)
    core.add(Add("r0", PROMPTS[0], 12, no_eos(runner)))
    outs: dict[str, list[RequestOutput]] = {}
    step_until(core, outs, 2)
    fail_next_step(runner)
    core.step()  # r0 through its first
    core.add(Add("r1", PROMPTS[1], 12, no_eos(runner)))
    step_until(core, outs, 3)
    fail_next_step(runner)  # r0 through its second, r1 through its first
    for rid, more in run_to_completion(core).items():
        outs.setdefault(rid, []).extend(more)

    last = outs["r0"][-1]
    assert last.finish_reason == "error" and last.token_ids == []
    assert last.error == "the device ran out of memory 2 times while this request was running"
    assert tokens_of(outs["r0"]) == expected["r0"][: len(tokens_of(outs["r0"]))]
    assert tokens_of(outs["r1"]) == expected["r1"]
    assert core.stats()["out_of_memory_steps"] == 2


def test_a_request_the_lowered_budget_cannot_hold_ends_with_an_error(
    core: EngineCore, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the device gave before it refused is the one measurement set here
    # (on this CPU MLX's buffer cache alone is several times the tiny model's
    # KV): exactly the big request's reservation beside the weights, so 90% of
    # it cannot hold that request again. The oldest request, a short one, keeps
    # its room and goes on; a request reaching the worker once it is idle
    # finds the configured budget again.
    need = core.governor.need(2000, 1900)
    real = runner.drop_all
    monkeypatch.setattr(runner, "drop_all", lambda: real() * 0 + runner.info.weights_bytes + need)
    core.add(Add("small", [3, 4, 5], 8, no_eos(runner)))
    core.add(Add("big", [3] * 2000, 1900, no_eos(runner)))
    outs: dict[str, list[RequestOutput]] = {}
    step_until(core, outs, 2)
    fail_next_step(runner)
    for rid, more in run_to_completion(core).items():
        outs.setdefault(rid, []).extend(more)
    last = outs["big"][-1]
    assert last.finish_reason == "error"
    assert last.error == (
        "the device ran out of memory, and this request no longer fits the memory left"
    )
    assert core.governor.budget < runner.info.weights_bytes + need
    assert len(tokens_of(outs["small"])) == 8, "the oldest request goes on"
    core.add(Add("later", [3, 4, 5], 4, GREEDY))
    assert core.governor.budget == 8 << 30
    assert run_to_completion(core)["later"][-1].finish_reason in ("length", "stop")


def test_an_abort_while_requeued_retires_the_request_once(core: EngineCore, runner: Runner) -> None:
    core.add(Add("a", PROMPTS[0], 12, no_eos(runner)))
    outs: dict[str, list[RequestOutput]] = {}
    step_until(core, outs, 2)
    fail_next_step(runner)
    core.step()  # the failed step: "a" is waiting again
    assert core.scheduler.waiting() == 1 and runner.active == 0
    core.abort(["a"])
    rest = run_to_completion(core)
    assert [o.finish_reason for o in rest["a"]] == ["abort"]
    assert core.scheduler.waiting() == 0


@pytest.mark.parametrize("case", ["another error", "a worker group"])
def test_what_cannot_be_recovered_still_escapes(
    core: EngineCore, runner: Runner, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    core.add(Add("a", [3, 4, 5], 4, GREEDY))
    if case == "a worker group":
        core.recover = False  # its ranks must step alike: core_for turns it off
        fail_next_step(runner)
        match = "out of memory"
    else:

        def broken() -> None:
            raise RuntimeError("a kernel failed")

        monkeypatch.setattr(runner, "step", broken)
        match = "a kernel failed"
    with pytest.raises(RuntimeError, match=match):
        core.step()
    assert core.stats()["out_of_memory_steps"] == 0
