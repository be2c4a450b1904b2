"""The batch caches' padding, read back to the host once for all layers instead of once per layer.

mlx-lm's BatchKVCache keeps each row's left padding as a device array, one per
layer, and reads it back whenever a row leaves a batch: `extract` (the
finished row's KV state, kept for the prefix cache) and `filter` (the rows
that stay, shifted left when the longest one left) each call `tolist()` on
their layer's array. On the H200 (issue #12, session 10, `bench.pacing_probe
--profile`, qwen0.5b shape) each read-back cost about 0.6 ms even of an array
already evaluated, and the first also waited for the step mlx-lm had queued:
the 48 of one finishing row took 30 ms of an 86 ms step, against a 13 ms
decode step. Every step in which a request ended, or a prompt left the prompt
batch beside others, paid them. (Evaluating every layer's array in one
`mx.eval` first was measured too: no better, the reads themselves cost.)

`install()` wraps the four places mlx-lm 0.32.2 does this
(GenerationBatch and PromptProcessingBatch, `extract_cache` and `filter`):
for a batch whose layers are all BatchKVCache, every layer's padding array is
stacked into one and read back once (`_paddings`), and each layer then does
with those host values what mlx-lm's own method does (`_filter_layers` and
`_extract_layers` mirror BatchKVCache.filter and .extract; the tests compare
them on the same states). Other cache types (rotating, SSM state) keep
mlx-lm's per-layer path. On a CPU the reads were cheap; nothing changes there
but their count. The rows a filter keeps are indexed with one slice or array
for all layers (`_rows`), not with a Python list per array.

With `host_padding` (on by default since session 33: on an H100, llama8b,
the step in which a shared-prefix turn's row ended took 22.7-24.0 ms
without it and 11.3-11.9 ms with it, its neighbours 10.7-11.6) there is
no read-back at all (session 11 measured the two stacked ones at 3 ms
together, of a 49.6 ms finishing step on the 0.5B shape). Every
BatchKVCache layer also keeps its rows' padding as a Python list beside
mlx-lm's array, updated wherever the array changes (`__init__`, `prepare`,
`finalize`, `extend`, the filter here), and the filter and the extract read
that list. A read-back is an `mx.stack` queued behind the step mlx-lm has
already started, so it waits for that step: in session 31's llama8b trace
(H200) the step where a shared-prefix turn's single row ended took 19-20 ms
against 9.6 ms for the steps around it, and a step where one of four rows
ended 10-12 ms against 6.5. A row that leaves
makes two read-backs, its extract for the prefix cache and the filter
(counted on this CPU, session 32). The lists are kept whether or not the
setting is on; a layer without one (a cache made some other way) is read
back as before.

`install()` also replaces BatchKVCache.extend, the join of rows into a
batch, with one that writes each array once (`one_write_extend`), and
BatchKVCache.update_and_fetch with one whose buffers stay whole multiples of
its 256-slot step (`aligned_update_and_fetch`) and, once `reserve` has said
how far a prompt batch will fill them, grow once to that length instead of
256 slots at a time.

Threading: engine thread only, like worker/runner.py. `install()` patches
mlx-lm's classes for the process, once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

_INSTALLED = "_mlxd_one_padding_read"


def _batch_kv(caches: Any) -> bool:
    return bool(caches) and all(type(c) is BatchKVCache for c in caches)


# Each BatchKVCache layer's left padding per row, on the host (module docstring).
_PAD = "_mlxd_padding"
# prepare()'s right padding, until finalize() folds it into the left.
_RIGHT = "_mlxd_right_padding"
# Whether the filter and the extract read `_PAD` instead of the device
# (WorkerConfig.host_padding; set by worker/core.py's runner_for).
host_padding = True


def _paddings(caches: list[Any]) -> list[list[int]]:
    """Every layer's left padding per row, in one read-back."""
    return cast(list[list[int]], mx.stack([c.left_padding for c in caches]).tolist())


def host_paddings(caches: list[Any]) -> list[list[int]] | None:
    """Every layer's left padding per row as the host keeps it; None where a
    layer keeps none."""
    kept = [c.__dict__.get(_PAD) for c in caches]
    return None if any(p is None for p in kept) else kept  # each replaced, never changed


def _known_paddings(caches: list[Any]) -> list[list[int]]:
    """The padding the filter and the extract use: the host's with
    `host_padding` where every layer keeps it, else one read-back."""
    kept = host_paddings(caches) if host_padding else None
    return kept if kept is not None else _paddings(caches)


MLX_LM_INIT = BatchKVCache.__init__
MLX_LM_PREPARE = BatchKVCache.prepare
MLX_LM_FINALIZE = BatchKVCache.finalize


def _mirrored_init(self: BatchKVCache, left_padding: list[int]) -> None:
    MLX_LM_INIT(self, left_padding)
    self.__dict__[_PAD] = [int(p) for p in left_padding]


def _mirrored_prepare(
    self: BatchKVCache,
    *,
    left_padding: list[int] | None = None,
    lengths: list[int] | None = None,
    right_padding: list[int] | None = None,
) -> None:
    MLX_LM_PREPARE(self, left_padding=left_padding, lengths=lengths, right_padding=right_padding)
    pad = self.__dict__.get(_PAD)
    if pad is not None and left_padding is not None:
        self.__dict__[_PAD] = [a + int(b) for a, b in zip(pad, left_padding, strict=True)]
    if right_padding is not None and max(right_padding) > 0:  # as mlx-lm keeps it
        self.__dict__[_RIGHT] = [int(p) for p in right_padding]


def _mirrored_finalize(self: BatchKVCache) -> None:
    right = self.__dict__.pop(_RIGHT, None) if self._right_padding is not None else None
    MLX_LM_FINALIZE(self)
    pad = self.__dict__.get(_PAD)
    if pad is not None and right is not None:
        self.__dict__[_PAD] = [a + b for a, b in zip(pad, right, strict=True)]


def _rows(keep: list[int]) -> slice | mx.array:
    """The index of the rows `keep` names, built once for every layer: a slice
    when they are one run (the usual case: the rows after a leaving one move
    up), else one index array. mlx-lm indexes each layer's four arrays with the
    Python list, which makes a new device array each time: on the H200
    (session 11, `bench.pacing_probe --profile`) the 96 of one finishing row
    took 10 ms of a 50 ms step."""
    first = keep[0]
    if keep == list(range(first, first + len(keep))):
        return slice(first, first + len(keep))
    return mx.array(keep, dtype=mx.int32)


def _filter_layers(caches: list[Any], keep: list[int]) -> None:
    """BatchKVCache.filter(keep) on every layer, with one read-back of the
    padding at most (none with `host_padding`)."""
    rows = _rows(keep)
    paddings = [[p[i] for i in keep] for p in _known_paddings(caches)]
    # one offset array shared by every layer (worker/fused.py, `next_offsets`)
    # stays one: gathered once
    offsets: dict[int, mx.array] = {}
    for c in caches:
        if c.keys is not None:
            c.keys = c.keys[rows]
            c.values = c.values[rows]
        if (kept := offsets.get(id(c.offset))) is None:
            kept = offsets[id(c.offset)] = c.offset[rows]
        c.offset = kept
        c.left_padding = c.left_padding[rows]
    for c, padding in zip(caches, paddings, strict=True):
        # Shift left to drop the padding no row needs any more (as mlx-lm does).
        shift = min(padding)
        if shift > 0:
            if c.keys is not None:
                c.keys = c.keys[..., shift:, :]
                c.values = c.values[..., shift:, :]
            c._idx -= shift
            c.left_padding -= shift
        c.__dict__[_PAD] = [p - shift for p in padding]


def _extract_layers(caches: list[Any], idx: int) -> list[KVCache]:
    """BatchKVCache.extract(idx) on every layer, with one read-back of the
    padding at most (none with `host_padding`)."""
    out = []
    for c, padding in zip(caches, _known_paddings(caches), strict=True):
        start = padding[idx]
        cache = KVCache()
        cache.keys = mx.contiguous(c.keys[idx : idx + 1, :, start : c._idx])
        cache.values = mx.contiguous(c.values[idx : idx + 1, :, start : c._idx])
        cache.offset = cache.keys.shape[2]
        out.append(cache)
    return out


def _one_read_filter(original: Callable[[Any, list[int]], None]) -> Callable[..., None]:
    @functools.wraps(original)
    def filter(self: Any, keep: list[int]) -> None:
        caches = self.prompt_cache
        if not keep or not _batch_kv(caches):
            original(self, keep)
            return
        _filter_layers(caches, keep)
        # mlx-lm's own filter for the rest of the batch's bookkeeping, with the
        # caches (already filtered) out of its reach.
        self.prompt_cache = []
        try:
            original(self, keep)
        finally:
            self.prompt_cache = caches

    return filter


def _one_read_extract(original: Callable[[Any, int], list[Any]]) -> Callable[..., list[Any]]:
    @functools.wraps(original)
    def extract_cache(self: Any, idx: int) -> list[Any]:
        if _batch_kv(self.prompt_cache):
            return _extract_layers(self.prompt_cache, idx)
        return original(self, idx)

    return extract_cache


MLX_LM_EXTEND = BatchKVCache.extend


def mirrored_extend(self: BatchKVCache, other: BatchKVCache) -> None:
    """`one_write_extend` with the host's padding joined as mlx-lm joins the
    arrays: each side's rows shifted right to the longer side's end."""
    mine, theirs = self.__dict__.get(_PAD), other.__dict__.get(_PAD)
    joined = None
    if mine is not None and theirs is not None:
        if self.keys is None and other.keys is None:
            joined = mine + theirs
        else:
            end = max(self._idx, other._idx)
            joined = [p + end - self._idx for p in mine] + [p + end - other._idx for p in theirs]
    one_write_extend(self, other)
    if joined is None:
        self.__dict__.pop(_PAD, None)
    else:
        self.__dict__[_PAD] = joined


def one_write_extend(self: BatchKVCache, other: BatchKVCache) -> None:
    """BatchKVCache.extend (another batch's rows after this one's), each array
    written once: the grown buffer, then each side's filled part copied into
    place, right-justified at the longer side's end as mlx-lm aligns them.
    mlx-lm pads both sides to the grown length and concatenates them, two
    whole copies of the batch's KV: when a long prompt joins short decode
    rows, every row's padding. On the H200 (session 17, `bench.shape_probe`,
    the 8B shape, 16 rows at 512 tokens joined by one at 2,000, every layer)
    6.5-7.0 ms against 3.8-4.4 ms this way; on this CPU 28 ms against 3.3.
    The slots past each row's end are zeros, where mlx-lm kept whatever its
    buffer held there; nothing reads them (attention takes the first `_idx`)."""
    if self.keys is None or other.keys is None or self.values is None or other.values is None:
        MLX_LM_EXTEND(self, other)  # an empty side: mlx-lm's own (it only pads that one)
        return
    end = max(self._idx, other._idx)
    size = max(self.keys.shape[2], other.keys.shape[2])
    top = self.keys.shape[0]

    def grown(a: mx.array, b: mx.array) -> mx.array:
        out = mx.zeros((top + b.shape[0], a.shape[1], size, a.shape[3]), a.dtype)
        if self._idx:
            out[:top, :, end - self._idx : end] = a[..., : self._idx, :]
        if other._idx:
            out[top:, :, end - other._idx : end] = b[..., : other._idx, :]
        return out

    self.keys, self.values = grown(self.keys, other.keys), grown(self.values, other.values)
    self.left_padding = mx.concatenate(
        [self.left_padding + (end - self._idx), other.left_padding + (end - other._idx)]
    )
    self.offset = mx.concatenate([self.offset, other.offset])
    self._idx = end


MLX_LM_UPDATE = BatchKVCache.update_and_fetch

# The slots a batch cache will be filled to (`reserve`); an attribute of the
# cache object, so it follows the batch wherever mlx-lm hands its caches.
_RESERVE = "_mlxd_reserve"
# Bytes grown ahead of need for a reserve since `take_ahead` last ran.
_ahead = 0


def reserve(caches: list[Any], slots: int) -> None:
    """Let every BatchKVCache layer of a prompt batch that will be filled to
    `slots` grow its buffer once to that length (on the step grid) when it
    next grows, instead of one 256-slot step at a time. Each growth is a new
    zeroed buffer and a copy of everything before it, per layer, keys and
    values: a long prompt paced in 256-token chunks paid 64 fills and 64
    copies on the 8B shape in every step (on the H200 the fused step is
    bound by its kernels: session 23's count, 2,579 primitives a fused step
    against 1,180 a decode one), and one in two steps at 128 tokens. The
    prompt's KV is reserved by the memory governor from admission on, so
    holding it sooner takes nothing the budget did not already set aside.
    Other cache types are left alone."""
    for c in caches:
        if type(c) is BatchKVCache:
            setattr(c, _RESERVE, slots)


def take_ahead() -> int:
    """The bytes buffers grew ahead of need for a `reserve` since the last
    call (then zero). They stay allocated, as the KV they will hold: the
    runner does not count them as a step's scratch (worker/governor.py
    learns the scratch per prompt token, and a prompt's whole KV allocated
    in its first chunk's step would read as that small pass's scratch)."""
    global _ahead
    grown, _ahead = _ahead, 0
    return grown


def grew_ahead(nbytes: int) -> None:
    """Count `nbytes` of KV buffers grown ahead of need elsewhere (the decode
    batch's room, worker/decode_rows.py) for the next `take_ahead`."""
    global _ahead
    _ahead += nbytes


def release(caches: list[Any]) -> None:
    """Forget `reserve`'s length: the caches now belong to a decode batch,
    whose rows leave and shift it left, so a length counted in its slots
    would go stale."""
    for c in caches:
        c.__dict__.pop(_RESERVE, None)


def aligned_update_and_fetch(
    self: BatchKVCache, keys: mx.array, values: mx.array
) -> tuple[mx.array, mx.array]:
    """BatchKVCache.update_and_fetch with the buffer grown to a multiple of
    `step` slots. mlx-lm cuts a buffer that is not one back to its filled
    length and appends whole steps, so it stays off the grid for good, and
    every cache that did not start empty is off it: one merged from prefix-
    cache entries (`merge` sizes it to the longest row), one a filter
    shifted left. A prompt chunk's attention runs over the buffer's filled
    steps (worker/fused.py, `_padded`), so its key length was a new,
    unaligned shape at nearly every chunk. On the H200 (session 20, the 8B shape) a
    pass of 991 tokens over 1,025 cached went from 55.0 to 46.7 ms on the
    device, and the second chunk of mlxd's cold 2,000-token prompts (8
    template tokens from the prefix cache) from 58-74 to 53-57 ms. A buffer
    that must grow grows to the `reserve`d length if that is further."""
    prev, n = self._idx, keys.shape[2]
    k, v = self.keys, self.values
    if k is None or v is None or prev + n > k.shape[2]:
        batch, heads, _, k_dim = keys.shape
        # The reserve is spent by the growth it sizes (FusedGenerator sets it
        # again before every prompt step).
        need = -(-(prev + n) // self.step) * self.step
        size = max(need, -(-self.__dict__.pop(_RESERVE, 0) // self.step) * self.step)
        if size > need:
            global _ahead
            _ahead += (size - need) * batch * heads * (k_dim + values.shape[3]) * keys.itemsize
        grown_k = mx.zeros((batch, heads, size, k_dim), keys.dtype)
        grown_v = mx.zeros((batch, heads, size, values.shape[3]), values.dtype)
        if prev and k is not None and v is not None:
            grown_k[..., :prev, :] = k[..., :prev, :]
            grown_v[..., :prev, :] = v[..., :prev, :]
        k, v = grown_k, grown_v
    k[:, :, prev : prev + n] = keys
    v[:, :, prev : prev + n] = values
    self.state = (k, v, self.offset + n, self.left_padding, prev + n)
    # mlx-lm's keys_and_values() with its index written out: an index with
    # an Ellipsis costs the host half again as much (bench.build_probe).
    return k[:, :, : prev + n], v[:, :, : prev + n]


def written(
    cache: BatchKVCache, keys: mx.array, values: mx.array, offset: mx.array
) -> tuple[mx.array, mx.array]:
    """`aligned_update_and_fetch`, handing back the whole buffers (whoever
    reads them takes the first `_idx` slots: the decode kernel by its mask,
    worker/decode_attention.py `takes_buffers`; a padded chunk's attention,
    worker/fused.py `_padded`) and taking the cache's new `offset` from the
    caller, one array every layer shares: every layer's offsets are the
    same (mlx-lm builds one mask for all of them from the first). The
    offset's Add and its Broadcast fewer every layer, and the slices of the
    buffers where their reader does not need them (worker/fused.py,
    `_attend`). A buffer without room grows as `aligned_update_and_fetch`
    grows it, and the offset stays the shared one there too."""
    prev, n, k, v = cache._idx, keys.shape[2], cache.keys, cache.values
    if k is None or v is None or prev + n > k.shape[2]:
        aligned_update_and_fetch(cache, keys, values)  # its slices go unread
        k, v = cast(mx.array, cache.keys), cast(mx.array, cache.values)  # grown
    else:
        k[:, :, prev : prev + n] = keys
        v[:, :, prev : prev + n] = values
    cache.state = (k, v, offset, cache.left_padding, prev + n)
    return k, v


def install() -> None:
    """Wrap mlx-lm's batch methods (module docstring); idempotent."""
    BatchKVCache.extend = mirrored_extend  # type: ignore[method-assign]
    BatchKVCache.__init__ = _mirrored_init  # type: ignore[method-assign]
    BatchKVCache.prepare = _mirrored_prepare  # type: ignore[method-assign]
    BatchKVCache.finalize = _mirrored_finalize  # type: ignore[method-assign]
    BatchKVCache.update_and_fetch = aligned_update_and_fetch  # type: ignore[method-assign]
    for cls in (GenerationBatch, PromptProcessingBatch):
        if getattr(cls, _INSTALLED, False):
            continue
        cls.filter = _one_read_filter(cls.filter)  # type: ignore[method-assign]
        cls.extract_cache = _one_read_extract(cls.extract_cache)  # type: ignore[method-assign]
        setattr(cls, _INSTALLED, True)
