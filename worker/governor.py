"""The memory governor: admission against an explicit memory budget.

    M_weights + M_live_state + M_reserved_growth + M_prefix_cache
        + M_temporary + M_other <= M_budget

- weights: measured (MLX active memory) right after the model loaded.
- live_state: KV bytes the batch holds now (BatchGenerator.prompt_cache_nbytes).
- reserved_growth: what admitted requests may still grow to: for each admitted
  request (prompt + max_tokens) x KV bytes per token, summed, minus live_state.
- prefix_cache: bytes held by the prefix cache (evicted first under pressure).
- temporary: the step scratch (peak minus active around a step) admission sets
  aside: what decode steps and short passes need (the floor), plus a prefill
  pass of `scratch_reserve_tokens`, fewer where that pass would take more
  than half the memory beside the weights (`Governor._set_aside`). On CUDA a
  pass's scratch grows with its prompt tokens and with how far back they
  attend (MLX keeps every op's inputs until the device ran them, and the host
  queues a whole pass ahead): on the H200's 8B shape a 2,048-token pass held
  12-22 GB, and setting that aside for every admission cut the KV room to a
  few requests (session 14). So the governor learns the scratch per prompt
  token for each span (a pass's furthest row end, in powers of two), sets
  aside a modest pass, and `pass_fits` tells the scheduler whether a larger
  pass fits the memory the KV reservations leave.
- other: everything else MLX holds (its buffer cache, small allocations):
  active + cache memory - all of the above.

M_budget is the configured budget until a step runs out of device memory
below it (another process took what it counted on): it then drops to the
weights plus 90% of what MLX held beside them in that step (keeping room for
the oldest running request), until a request reaches an idle worker, which
tries the configured budget again (worker/core.py's recovery).

Admission reserves a request's full KV footprint before its state is attached.
A request that does not fit now is deferred (it waits at the head of the
queue); one that could not fit even on an empty worker is rejected. The
governor never deadlocks: with nothing admitted, a request that fits the empty
machine is always admitted.

Pure arithmetic over numbers the engine feeds it: no MLX import, engine
thread only.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    budget_bytes: int  # M_budget
    kv_bytes_per_token: int
    kv_budget_bytes: int = 0  # optional cap on KV state (live + reserved + prefix); 0: none
    # Prompt tokens a prefill pass may always hold: their scratch is set aside.
    scratch_reserve_tokens: int = 512


# Passes shorter than this teach the scratch floor, not the per-token rate (their
# scratch is mostly the decode rows' and the fixed part of a pass).
SCRATCH_MIN_TOKENS = 64


# After an allocation failed, the budget beside the weights is this fraction of
# what MLX held beside them then.
OUT_OF_MEMORY_MARGIN = 0.9


def span_bucket(span: int) -> int:
    """The power of two at or above `span`."""
    return 1 << max(0, span - 1).bit_length()


def default_budget_bytes(fraction: float = 0.75, device_bytes: int | None = None) -> int:
    """A safe share of what this machine can give the model.

    macOS: of Metal's recommended working set (passed in as device_bytes);
    elsewhere: of physical memory, or of the accelerator's memory when given.
    """
    if device_bytes:
        return int(device_bytes * fraction)
    if sys.platform == "darwin" or hasattr(os, "sysconf"):
        try:
            phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return int(phys * fraction)
        except (ValueError, OSError):
            pass
    return 8 << 30


def kv_room_warning(capacity: int, kv_bytes_per_token: int, context_length: int) -> str | None:
    """What to tell the operator when the budget's KV room (`Governor.kv_capacity`
    after the warm-up) cannot hold one request of the model's whole context;
    None when it can. Requests needing more are rejected at admission, so a
    worker whose room is below a short chat's (session 29: negative, on a
    23.9 GiB budget for 15 GiB of weights) would otherwise look healthy and
    refuse everything."""
    if kv_bytes_per_token <= 0 or capacity >= kv_bytes_per_token * context_length:
        return None
    tokens = max(0, capacity) // kv_bytes_per_token
    return (
        f"the memory budget leaves {max(0, capacity) / 2**20:.1f} MiB for KV state, "
        f"{tokens} tokens of the model's {context_length}: a request whose prompt and "
        "max_tokens need more is rejected. Raise memory_budget_bytes "
        "(MLXD_MEMORY_BUDGET_BYTES), or memory_bytes in a models list"
    )


class Governor:
    def __init__(self, config: GovernorConfig, weights_bytes: int) -> None:
        self.config = config
        # M_budget: the configured one, lowered where the device ran out below it
        # (`out_of_memory`)
        self.budget = config.budget_bytes
        self.weights = weights_bytes
        self.temporary = 0  # what admission sets aside for step scratch
        self.peak_scratch = 0  # the largest step scratch seen
        self.scratch_floor = 0  # the largest scratch of a step with a short pass or none
        # the prompt tokens of the pass whose scratch admission sets aside (`_set_aside`)
        self.reserve_tokens = config.scratch_reserve_tokens
        # span bucket -> the largest scratch per prompt token above the floor
        self.scratch_rates: dict[int, int] = {}
        self._reserved: dict[str, int] = {}  # request id -> full KV footprint
        self.deferrals = 0

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        return (prompt_tokens + max_tokens) * self.config.kv_bytes_per_token

    @property
    def reserved_total(self) -> int:
        return sum(self._reserved.values())

    def kv_capacity(self, other: int = 0) -> int:
        """Bytes left for KV state (live, reserved, prefix cache) on this machine."""
        capacity = self.budget - self.weights - self.temporary - other
        if self.config.kv_budget_bytes:
            capacity = min(capacity, self.config.kv_budget_bytes)
        return capacity

    def could_ever_fit(self, need: int) -> bool:
        return need <= self.kv_capacity()

    def admit(
        self, request_id: str, need: int, prefix_bytes: int, other: int = 0
    ) -> tuple[bool, int]:
        """Try to reserve `need`; returns (admitted, prefix-cache bytes to evict first)."""
        if request_id in self._reserved:
            return True, 0
        capacity = self.kv_capacity(other)
        free = capacity - self.reserved_total - prefix_bytes
        if need <= free:
            self._reserved[request_id] = need
            return True, 0
        if need <= free + prefix_bytes:
            # Evicting cached prefixes makes room: the caller evicts, then we admit.
            self._reserved[request_id] = need
            return True, need - free
        if not self._reserved and need <= capacity:
            # Never deadlock: an idle worker admits anything the empty machine fits.
            self._reserved[request_id] = need
            return True, prefix_bytes
        self.deferrals += 1
        return False, 0

    def reserve(self, request_id: str, need: int) -> None:
        """Record a reservation decided elsewhere (a follower rank of a group)."""
        self._reserved[request_id] = need

    def release(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)

    def out_of_memory(self, held_bytes: int, keep: int = 0) -> int:
        """The device refused an allocation while MLX held `held_bytes` (the failed
        step's peak and its buffer cache): the memory the budget counted on is
        not there (another process holds it). The budget drops to the weights
        plus `OUT_OF_MEMORY_MARGIN` of what was held beside them, but keeps room
        for a request of `keep` KV bytes (the oldest one running: the worker
        always goes on with one), and never rises until `restore`; returns it."""
        beside = max(0, held_bytes - self.weights)
        lowered = self.weights + int(beside * OUT_OF_MEMORY_MARGIN)
        self.budget = min(self.budget, lowered)
        self.temporary = self._set_aside()  # a smaller pass where the room shrank
        self.budget = max(
            self.budget, min(self.config.budget_bytes, self.weights + self.temporary + keep)
        )
        return self.budget

    def restore(self) -> bool:
        """The configured budget again (the worker is idle: trying it risks no
        request); whether it had been lowered."""
        if self.budget == self.config.budget_bytes:
            return False
        self.budget = self.config.budget_bytes
        self.temporary = self._set_aside()
        return True

    def observe_scratch(self, scratch_bytes: int, prompt_tokens: int, span: int) -> bool:
        """Learn from one step's scratch, the prompt tokens its pass held and the
        pass's span (its furthest row end); whether the scratch is a new high
        (the worker logs which step set it)."""
        if prompt_tokens < SCRATCH_MIN_TOKENS:
            learnt = scratch_bytes > self.scratch_floor
            self.scratch_floor = max(self.scratch_floor, scratch_bytes)
        else:
            # No span known (a pass the core did not plan): as if one row held them all.
            bucket = span_bucket(span or prompt_tokens)
            rate = -(-max(0, scratch_bytes - self.scratch_floor) // prompt_tokens)
            learnt = rate > self.scratch_rates.get(bucket, 0)
            if learnt:
                self.scratch_rates[bucket] = rate
        if learnt:  # most steps teach nothing: the set-aside stays
            self.temporary = self._set_aside()
        if scratch_bytes <= self.peak_scratch:
            return False
        self.peak_scratch = scratch_bytes
        return True

    def _set_aside(self) -> int:
        """The floor plus the scratch of a pass of `reserve_tokens`: at most
        `scratch_reserve_tokens`, halved (down to SCRATCH_MIN_TOKENS) while
        that pass would take more than half of the memory beside the weights
        and the floor. On an H100 (session 29, llama8b, three targets sharing
        the GPU: a 23.9 GiB budget for 15.0 GiB of weights) a 448-token pass
        taught 9 MiB a token; the 512-token pass, at twice that span, came to
        9,251 MiB, and with the floor the set-aside outgrew the 8.9 GiB beside
        the weights: every request was rejected, 131 tokens as well. A smaller
        set-aside costs only prefill speed under a full KV load: `pass_fits`
        still lets larger passes use what the reservations leave."""
        room = self.budget - self.weights - self.scratch_floor
        tokens = self.config.scratch_reserve_tokens
        pass_bytes = tokens * (self.rate(tokens) or 0)
        while pass_bytes > room // 2 and tokens > SCRATCH_MIN_TOKENS:
            tokens = max(SCRATCH_MIN_TOKENS, tokens // 2)
            pass_bytes = tokens * (self.rate(tokens) or 0)
        self.reserve_tokens = tokens
        return self.scratch_floor + pass_bytes

    def rate(self, span: int) -> int | None:
        """Scratch per prompt token of a pass reaching `span`: the largest rate
        learnt at or below the nearest learnt span bucket above it (the rate
        grows with the span; a smaller span's higher rate is noise to respect),
        or beyond every learnt span the largest rate scaled by the span (per
        token it grows no faster). None until a pass has taught one."""
        if not self.scratch_rates:
            return None
        bucket = span_bucket(span)
        above = [b for b in self.scratch_rates if b >= bucket]
        if above:
            nearest = min(above)
            return max(r for b, r in self.scratch_rates.items() if b <= nearest)
        top = max(self.scratch_rates)
        return -(-max(self.scratch_rates.values()) * bucket // top)

    def pass_fits(self, tokens: int, span: int, prefix_bytes: int) -> bool:
        """Whether a prefill pass of `tokens` prompt tokens reaching `span` fits
        the memory beside the weights, the KV reservations and the prefix cache.
        A pass within what admission set aside always fits; with nothing learnt
        yet, any pass does."""
        rate = self.rate(span)
        if rate is None:
            return True
        free = self.budget - self.weights - self.reserved_total - prefix_bytes
        return rate * tokens <= max(free, self.temporary) - self.scratch_floor

    def terms(self, live_state: int, prefix_bytes: int, active: int, cache: int) -> dict[str, Any]:
        reserved_growth = max(0, self.reserved_total - live_state)
        other = max(0, active + cache - self.weights - live_state - prefix_bytes)
        used = self.weights + live_state + reserved_growth + prefix_bytes + self.temporary + other
        return {
            "budget": self.budget,
            "weights": self.weights,
            "live_state": live_state,
            "reserved_growth": reserved_growth,
            "prefix_cache": prefix_bytes,
            "temporary": self.temporary,
            "other": other,
            "total": used,
            "headroom": self.budget - used,
            "reserved_requests": len(self._reserved),
            "kv_bytes_per_token": self.config.kv_bytes_per_token,
            "deferrals": self.deferrals,
            "peak_scratch": self.peak_scratch,
            "scratch_per_token": self.rate(self.reserve_tokens) or 0,
            "scratch_reserve_tokens": self.reserve_tokens,
        }
