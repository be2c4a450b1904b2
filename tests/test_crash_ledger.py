"""The replay and crash-budget rule (gateway/workers/crash_ledger.py), without processes."""

from __future__ import annotations

from gateway.workers.crash_ledger import POISON_DEATHS, CrashLedger


def test_a_poison_request_costs_two_deaths_and_no_budget() -> None:
    ledger = CrashLedger(window_s=600)
    assert POISON_DEATHS == 2
    ledger.worker_lost(1, ["poison", "bystander"])
    assert ledger.record_crash(1, now=0.0) == 1  # not yet known to be poison: counts
    assert ledger.deaths("poison") == 1 and ledger.deaths("bystander") == 1
    ledger.worker_lost(2, ["poison"])  # replayed once, killed the next worker too
    assert ledger.poisoned == 1
    # Both of its deaths are forgiven, the one already recorded included.
    assert ledger.record_crash(2, now=1.0) == 0
    # A crash no poison request explains still counts.
    ledger.worker_lost(3, ["innocent"])
    assert ledger.record_crash(3, now=2.0) == 1


def test_crashes_leave_the_window_and_a_reset_starts_over() -> None:
    ledger = CrashLedger(window_s=10)
    for epoch in range(1, 4):
        ledger.worker_lost(epoch, [])
        ledger.record_crash(epoch, now=float(epoch))
    assert ledger.record_crash(4, now=12.5) == 2  # epochs 1 and 2 are older than 10 s
    ledger.reset()
    assert ledger.record_crash(5, now=13.0) == 1


def test_memory_is_bounded() -> None:
    ledger = CrashLedger(window_s=600, max_requests=100)
    for epoch in range(1, 11):
        ledger.worker_lost(epoch, [f"r{epoch}-{i}" for i in range(50)])
    assert ledger.deaths("r1-0") == 0  # forgotten, oldest first
    assert ledger.deaths("r10-49") == 1
    assert ledger.poisoned == 0
