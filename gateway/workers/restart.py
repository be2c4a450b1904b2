"""A supervisor's restart policy and its arithmetic: backoff, crash budget, FAILED's cool-down.

`RestartPolicy` is built from Settings only (Settings holds every default).
`RestartBudget` is pure, with time passed in: the delay before each restart
(exponential, reset after a stable run), the crash budget (N counted crashes
within M seconds end in FAILED; which crashes count is the crash ledger's rule,
gateway/workers/crash_ledger.py), and the cool-down before a FAILED model is
started again (doubling per consecutive failure). gateway/workers/supervisor.py
applies them.

Threading: event loop only (one supervisor's state).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import Settings
from gateway.workers.crash_ledger import CrashLedger


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """The supervisor's restart and watchdog policy; Settings holds every default."""

    backoff_initial_s: float
    backoff_max_s: float
    stable_s: float  # uptime after which the backoff starts over
    crash_budget: int  # crashes within crash_window_s that end in FAILED
    crash_window_s: float
    watchdog_s: float  # no step progress with work in flight for this long: wedged
    # No heartbeat for this long: gone or frozen. At least four beats, so a
    # worker told to beat slowly is not declared dead between two beats.
    heartbeat_timeout_s: float
    failed_retry_s: float  # FAILED by the crash budget: first cool-down; 0: never
    failed_retry_max_s: float  # the cool-down doubles up to this

    @classmethod
    def from_settings(cls, s: Settings) -> RestartPolicy:
        return cls(
            backoff_initial_s=s.restart_backoff_initial_s,
            backoff_max_s=s.restart_backoff_max_s,
            stable_s=s.restart_stable_s,
            crash_budget=s.restart_crash_budget,
            crash_window_s=s.restart_crash_window_s,
            watchdog_s=s.watchdog_s,
            heartbeat_timeout_s=max(s.heartbeat_timeout_s, 4 * s.worker_heartbeat_s),
            failed_retry_s=s.failed_retry_s,
            failed_retry_max_s=s.failed_retry_max_s,
        )


class RestartBudget:
    """Restart backoff, the crash budget and FAILED's cool-down of one supervisor.

    Pure: time is passed in. Which crashes count is the crash ledger's rule
    (gateway/workers/crash_ledger.py): deaths a poison request explains do not.
    """

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.backoff = policy.backoff_initial_s
        self.ledger = CrashLedger(policy.crash_window_s)
        self.counted = 0  # crashes that counted in the window at the last crash
        self.failures = 0  # consecutive crash-budget failures (the cool-down doubles)

    def crashed(self, now: float, ready_at: float | None, epoch: int) -> float | None:
        """Record the crash of `epoch`'s worker at `now`: the delay before the next
        start (before jitter), or None once `crash_budget` counted crashes fall
        within `crash_window_s`.

        The delay doubles per crash up to `backoff_max_s`, and starts over (as does
        the cool-down) after a worker that was ready (at `ready_at`) stayed up
        longer than `stable_s`.
        """
        p = self.policy
        self.counted = self.ledger.record_crash(epoch, now)
        if ready_at is not None and now - ready_at > p.stable_s:
            self.backoff = p.backoff_initial_s
            self.failures = 0
        if self.counted >= p.crash_budget:
            return None
        delay, self.backoff = self.backoff, min(self.backoff * 2, p.backoff_max_s)
        return delay

    def cool_down_s(self) -> float | None:
        """FAILED by the crash budget: the wait before the next start (None: stay FAILED).

        `failed_retry_s`, doubling on each consecutive failure up to `failed_retry_max_s`.
        """
        first = self.policy.failed_retry_s
        if first <= 0:
            return None
        delay = min(first * 2**self.failures, max(first, self.policy.failed_retry_max_s))
        self.failures += 1
        return delay

    def restart_after_cool_down(self) -> None:
        """A fresh budget and backoff for the start after a cool-down."""
        self.ledger.reset()
        self.backoff = self.policy.backoff_initial_s
