"""The prefix cache: KV state of earlier requests, reused for prompts that share a prefix.

A thin wrapper over mlx-lm's `LRUPromptCache` (a token-id trie with a byte
bound) that adds:
- the model identity in every key, so a state computed by other weights,
  quantization or adapters can never be reused;
- a guard for mlx-lm's exact-hit defect: an exact match leaves an empty suffix
  and `BatchGenerator.insert` raises "empty prompt", so one prompt token is
  always left to process (the reused cache is trimmed by one);
- counters: lookups, hits, reused tokens, estimated prefill time saved, bytes,
  insertions and evictions.

Threading: engine thread only (it holds MLX arrays).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache


@dataclass(slots=True)
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    saved_prefill_s: float = 0.0
    inserts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


class PrefixCache:
    def __init__(self, identity: str, max_bytes: int, max_entries: int = 256) -> None:
        self.identity = identity
        self.max_bytes = max_bytes
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max(max_bytes, 0))
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(
        self, prompt: list[int], prefill_s_per_token: float | None = None
    ) -> tuple[list[Any] | None, int]:
        """A private copy of the longest reusable state and how many tokens it covers.

        The returned cache covers prompt[:n] with n <= len(prompt) - 1.
        """
        if not self.enabled:
            return None, 0
        self.stats.lookups += 1
        cache, rest = self._lru.fetch_nearest_cache(self.identity, prompt)
        if cache is None:
            return None, 0
        if not rest:
            # Exact hit: keep the last prompt token uncached (see module doc).
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        reused = len(prompt) - len(rest)
        if reused <= 0:
            return None, 0
        self.stats.hits += 1
        self.stats.reused_tokens += reused
        if prefill_s_per_token:
            self.stats.saved_prefill_s += reused * prefill_s_per_token
        return cache, reused

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep `cache` (the KV state of `tokens`) for later prompts."""
        if not self.enabled or not tokens:
            return
        # The extracted state is a lazy copy of a slice of the batch's KV buffer:
        # evaluate it now, or the entry pins the whole batch buffer.
        mx.eval([c.state for c in cache])
        before = len(self._lru), self.nbytes
        self._lru.insert_cache(self.identity, list(tokens), cache)
        self.stats.inserts += 1
        self._count_evictions(before, entries_added=1)

    def trim_to(self, max_bytes: int) -> int:
        """Evict least recently used entries until at most max_bytes remain; bytes freed."""
        before = len(self._lru), self.nbytes
        self._lru.trim_to(n_bytes=max(0, max_bytes))
        self._count_evictions(before, entries_added=0)
        return before[1] - self.nbytes

    def clear(self) -> int:
        return self.trim_to(0)

    def _count_evictions(self, before: tuple[int, int], entries_added: int) -> None:
        n_before, bytes_before = before
        gone = n_before + entries_added - len(self._lru)
        if gone > 0:
            self.stats.evictions += gone
            if entries_added == 0:
                self.stats.evicted_bytes += bytes_before - self.nbytes

    def snapshot(self) -> dict[str, Any]:
        return {
            **asdict(self.stats),
            "bytes": self.nbytes,
            "entries": len(self._lru),
            "max_bytes": self.max_bytes,
        }
