"""The supervisor's restart backoff, crash budget and FAILED's cool-down (gateway/workers/restart).

Pure logic with the clock passed in; tests/test_supervision.py covers the same
policy end to end with real crashing workers.
"""

from __future__ import annotations

from gateway.config import Settings
from gateway.workers.restart import RestartBudget, RestartPolicy


def _policy(**kw: float) -> RestartPolicy:
    base = {
        "backoff_initial_s": 0.5,
        "backoff_max_s": 4.0,
        "stable_s": 60.0,
        "crash_budget": 100,
        "crash_window_s": 600.0,
        "watchdog_s": 120.0,
        "heartbeat_timeout_s": 5.0,
        "failed_retry_s": 60.0,
        "failed_retry_max_s": 300.0,
    }
    return RestartPolicy(**{**base, **kw})  # type: ignore[arg-type]


def test_backoff_doubles_up_to_its_cap() -> None:
    budget = RestartBudget(_policy())
    delays = [budget.crashed(float(t), ready_at=None, epoch=t) for t in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_backoff_starts_over_after_a_stable_run() -> None:
    budget = RestartBudget(_policy())
    delays = [budget.crashed(t, ready_at=t - 1, epoch=int(t)) for t in (1.0, 2.0, 3.0)]
    assert delays == [0.5, 1.0, 2.0]
    # This worker was up for longer than stable_s before it crashed.
    assert budget.crashed(200.0, ready_at=100.0, epoch=4) == 0.5
    assert budget.crashed(201.0, ready_at=200.5, epoch=5) == 1.0


def test_crash_budget_spent_within_the_window() -> None:
    budget = RestartBudget(_policy(crash_budget=3, crash_window_s=10.0))
    assert budget.crashed(0.0, None, epoch=1) is not None
    assert budget.crashed(1.0, None, epoch=2) is not None
    assert budget.crashed(2.0, None, epoch=3) is None  # the third crash within 10 s: FAILED


def test_crashes_outside_the_window_do_not_count() -> None:
    budget = RestartBudget(_policy(crash_budget=3, crash_window_s=10.0))
    for epoch, t in enumerate((0.0, 5.0, 16.0, 27.0, 38.0), 1):  # never three within 10 s
        assert budget.crashed(t, None, epoch) is not None
    assert budget.counted == 1


def test_crashes_a_poison_request_explains_do_not_count() -> None:
    budget = RestartBudget(_policy(crash_budget=2, crash_window_s=10.0))
    budget.ledger.worker_lost(1, ["poison"])
    assert budget.crashed(0.0, None, epoch=1) is not None
    budget.ledger.worker_lost(2, ["poison"])  # its second death: poison, both forgiven
    assert budget.crashed(1.0, None, epoch=2) is not None
    assert budget.counted == 0


def test_cool_down_doubles_up_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    budget = RestartBudget(_policy())
    assert [budget.cool_down_s() for _ in range(4)] == [60.0, 120.0, 240.0, 300.0]
    budget.crashed(500.0, ready_at=400.0, epoch=1)  # up longer than stable_s
    assert budget.cool_down_s() == 60.0
    assert RestartBudget(_policy(failed_retry_s=0.0)).cool_down_s() is None  # stays FAILED


def test_policy_comes_from_settings_only() -> None:
    s = Settings(heartbeat_timeout_s=5.0, worker_heartbeat_s=2.0, watchdog_s=120.0)
    policy = RestartPolicy.from_settings(s)
    assert policy.watchdog_s == 120.0
    # At least four beats: a slowly beating worker is not declared dead between two.
    assert policy.heartbeat_timeout_s == 8.0
    assert policy.backoff_initial_s == s.restart_backoff_initial_s
