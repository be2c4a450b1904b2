"""worker/prefix_cache.py: what its entries take in MLX's allocator (`allocated_bytes`)."""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from worker.prefix_cache import PrefixCache


def _state(tokens: int, layers: int = 2) -> list[KVCache]:
    """A cached request's KV: `layers` plain caches of `tokens` float16 slots (8 bytes a token)."""
    out = []
    for _ in range(layers):
        c = KVCache()
        c.keys = mx.zeros((1, 1, tokens, 4), dtype=mx.float16)
        c.values = mx.zeros((1, 1, tokens, 4), dtype=mx.float16)
        c.offset = tokens
        out.append(c)
    return out


def _rounded(n: int) -> int:
    return -(-n // 1000) * 1000  # an allocator with 1,000-byte pages


def test_allocated_bytes_charges_each_array_and_gives_back_what_leaves() -> None:
    cache = PrefixCache("m", max_bytes=10_000, charge=_rounded)
    cache.insert(list(range(10)), _state(10))  # 80 bytes an array: 1,000 charged
    cache.insert(list(range(100, 200)), _state(100))  # 800 bytes an array: 1,000
    snap = cache.snapshot()
    assert snap["bytes"] == 4 * 80 + 4 * 800
    assert snap["allocated_bytes"] == 8 * 1000
    # an entry replaced by a longer one sharing it leaves with its buffers
    cache.insert(list(range(10)) + [7] * 190, _state(200))  # 1,600 bytes: 2,000 each
    gc.collect()
    assert cache.snapshot()["allocated_bytes"] == 4 * 1000 + 4 * 2000
    # over the byte bound (4 x 800 + 4 x 1,600 + 4 x 1,200 > 10,000), the least
    # recently used leave until it fits: here both older entries
    cache.insert(list(range(300, 450)), _state(150))
    gc.collect()
    snap = cache.snapshot()
    assert (snap["entries"], snap["bytes"]) == (1, 4 * 1200)
    assert snap["allocated_bytes"] == 4 * 2000
    cache.clear()
    gc.collect()
    assert cache.snapshot()["allocated_bytes"] == 0


def test_without_a_charge_the_buffers_are_the_contents() -> None:
    cache = PrefixCache("m", max_bytes=1 << 20)
    cache.insert(list(range(33)), _state(33, layers=3))
    snap = cache.snapshot()
    assert snap["allocated_bytes"] == snap["bytes"] == 6 * 33 * 8
