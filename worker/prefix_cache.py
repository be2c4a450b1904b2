"""The prefix cache: KV state of earlier requests, reused for prompts that share a prefix.

A thin wrapper over mlx-lm's `LRUPromptCache` (a token-id trie with a byte
bound) that adds:
- the model identity in every key, so a state computed by other weights,
  quantization or adapters can never be reused;
- a guard for mlx-lm's exact-hit defect: an exact match leaves an empty suffix
  and `BatchGenerator.insert` raises "empty prompt", so one prompt token is
  always left to process (the reused cache is trimmed by one);
- a lookup of its own (`_nearest`, `_reuse`) over mlx-lm's trie: mlx-lm's
  `fetch_nearest_cache`, when the prompt shares only part of a cached
  prompt (a chat template's first tokens, say), searched the rest of that
  entry by copying the path list at every trie node (O(L^2) for an L-token
  entry: 15 ms on this CPU for four 2,000-token entries sharing 5 tokens with
  the prompt, on the engine thread, in the step that admits it; on the H200
  a fused prompt's first step cost 56-63 ms against about 30 for the next),
  and then deep-copied the whole entry's KV to trim it to the shared part.
  Here the walk is O(L) and a reused prefix is a slice of the entry's KV
  (only the tokens reused), for plain KVCache layers; other cache types keep
  mlx-lm's copy and trim;
- counters: lookups, hits, reused tokens, estimated prefill time saved, bytes,
  insertions and evictions;
- `allocated_bytes`: what the entries' arrays take in MLX's allocator (their
  buffers, rounded to its pages: worker/backend.py `allocated_bytes`), where
  `bytes` is their contents. Charged when an entry is added and given back
  when its arrays are dropped (a finalizer on its first layer), so reading it
  costs nothing: stats and metrics read it between steps;
- deferred insertion: `insert` queues a finished or aborted request's state and
  `flush` evaluates and adds it. Evaluating it waits for the step the generator
  has already queued on the device (mlx-lm runs one step ahead), so inserting
  at once delayed every output of the step in which a request finished or was
  aborted by about one step; the engine flushes at the start of its next step,
  after those outputs left. Every read of the cache flushes first, so nothing
  ever sees the queue.

Threading: engine thread only (it holds MLX arrays).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

_VALUE = "__value__"  # where mlx-lm's PromptTrie keeps a node's entry


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
    def __init__(
        self,
        identity: str,
        max_bytes: int,
        max_entries: int = 256,
        charge: Callable[[int], int] | None = None,
    ) -> None:
        """`charge`: what MLX's allocator takes for an array of n bytes
        (worker/backend.py `allocated_bytes`); None: n."""
        self.identity = identity
        self.max_bytes = max_bytes
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max(max_bytes, 0))
        self.stats = PrefixCacheStats()
        self._queued: list[tuple[list[int], list[Any]]] = []
        self._charge = charge or (lambda n: n)
        self.allocated_bytes = 0  # the entries' buffers (module doc)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def queued(self) -> bool:
        """States inserted but not yet evaluated and added (`flush`)."""
        return bool(self._queued)

    @property
    def nbytes(self) -> int:
        self.flush()
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        self.flush()
        return len(self._lru)

    def lookup(
        self, prompt: list[int], prefill_s_per_token: float | None = None
    ) -> tuple[list[Any] | None, int]:
        """A private copy of the longest reusable state and how many tokens it covers.

        The returned cache covers prompt[:n] with n <= len(prompt) - 1.
        """
        if not self.enabled:
            return None, 0
        self.flush()
        self.stats.lookups += 1
        found = self._nearest(prompt)
        if found is None:
            return None, 0
        entry, length, covered = found
        # At most all but the last prompt token (the exact-hit guard, module doc).
        reused = min(covered, len(prompt) - 1)
        cache = self._reuse(entry, length, reused) if reused > 0 else None
        if cache is None:
            return None, 0
        self.stats.hits += 1
        self.stats.reused_tokens += reused
        if prefill_s_per_token:
            self.stats.saved_prefill_s += reused * prefill_s_per_token
        return cache, reused

    def _nearest(self, prompt: list[int]) -> tuple[Any, int, int] | None:
        """(the cached entry to reuse, its length in tokens, how many of
        `prompt`'s tokens it shares), as mlx-lm chooses it: the entry sharing
        the longest prefix (a longer entry only when it shares more than the
        longest cached prefix of the prompt). One walk down the trie, then down
        any branch to an entry."""
        node = self._lru._trie._trie.get(self.identity)
        if node is None:
            return None
        depth = shorter = 0
        at_shorter = None
        while depth < len(prompt) and prompt[depth] in node:
            node = node[prompt[depth]]
            depth += 1
            if _VALUE in node:
                shorter, at_shorter = depth, node
        if depth > shorter:
            # No entry ends here, so the node has children: any entry below
            # shares these `depth` tokens (only they are reused).
            length = depth
            while _VALUE not in node:
                node = node[next(iter(node))]
                length += 1
            return node[_VALUE], length, depth
        if at_shorter is not None:
            return at_shorter[_VALUE], shorter, shorter
        return None

    def _reuse(self, entry: Any, length: int, n: int) -> list[Any] | None:
        """A private cache of the first `n` of the `length` tokens `entry` holds."""
        layers = entry.prompt_cache
        if all(type(c) is KVCache and c.keys is not None for c in layers):
            out = []
            for c in layers:
                # A slice, not a copy of the whole entry: MLX arrays are values,
                # so the row's later writes never reach the entry's buffers.
                layer = KVCache()
                layer.keys, layer.values = c.keys[..., :n, :], c.values[..., :n, :]
                layer.offset = n
                out.append(layer)
            return out
        if length > n and not can_trim_prompt_cache(layers):
            return None
        cache = copy.deepcopy(layers)  # mlx-lm's way, for other cache types
        if length > n:
            trim_prompt_cache(cache, length - n)
        return cache

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep `cache` (the KV state of `tokens`) for later prompts, at the next flush."""
        if self.enabled and tokens:
            self._queued.append((list(tokens), cache))

    def flush(self) -> int:
        """Evaluate the queued states and add them; how many were added."""
        if not self._queued:
            return 0
        queued, self._queued = self._queued, []
        # Each state is a lazy copy of a slice of the batch's KV buffer:
        # scheduled here, so that no entry pins the whole batch buffer (MLX
        # drops an array's inputs once it is scheduled). Not waited for: the
        # copies read the batch after the step already queued on the device,
        # and waiting for them stalled the next step's graph behind it.
        mx.async_eval([c.state for _, cache in queued for c in cache])
        for tokens, cache in queued:
            before = len(self._lru), int(self._lru.nbytes)
            self._account(cache)
            self._lru.insert_cache(self.identity, tokens, cache)
            self.stats.inserts += 1
            self._count_evictions(before, entries_added=1)
        return len(queued)

    def _account(self, cache: list[Any]) -> None:
        """Charge `cache`'s buffers to `allocated_bytes` until its layers are
        dropped (evicted, replaced, cleared, or refused by mlx-lm's bounds).
        Nothing else holds an entry's layers: a reuse builds its own, whose
        slices of the entry's arrays live only until the row joins the batch."""
        if not cache:
            return
        charged = 0
        for c in cache:
            if type(c) is KVCache and c.keys is not None and c.values is not None:
                charged += self._charge(c.keys.nbytes) + self._charge(c.values.nbytes)
            else:
                charged += self._charge(int(c.nbytes))
        self.allocated_bytes += charged
        weakref.finalize(cache[0], self._uncharge, charged).atexit = False

    def _uncharge(self, charged: int) -> None:
        self.allocated_bytes -= charged

    def trim_to(self, max_bytes: int) -> int:
        """Evict least recently used entries until at most max_bytes remain; bytes freed."""
        self.flush()
        before = len(self._lru), self.nbytes
        self._lru.trim_to(n_bytes=max(0, max_bytes))
        self._count_evictions(before, entries_added=0)
        return before[1] - self.nbytes

    def clear(self) -> int:
        self._queued.clear()
        return self.trim_to(0)

    def _count_evictions(self, before: tuple[int, int], entries_added: int) -> None:
        n_before, bytes_before = before
        gone = n_before + entries_added - len(self._lru)
        if gone > 0:
            self.stats.evictions += gone
            if entries_added == 0:
                self.stats.evicted_bytes += bytes_before - self.nbytes

    def snapshot(self) -> dict[str, Any]:
        self.flush()
        return {
            **asdict(self.stats),
            "bytes": self.nbytes,
            "allocated_bytes": self.allocated_bytes,
            "entries": len(self._lru),
            "max_bytes": self.max_bytes,
        }
