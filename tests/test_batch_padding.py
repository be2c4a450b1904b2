"""worker/batch_padding.py: a row leaving a batch reads the padding back once
for all layers, and leaves every layer's cache exactly as mlx-lm's own
per-layer methods do. These are the read-back path's tests (`host_padding`
off); tests/test_fused.py has the host lists' (on, the default)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker import batch_padding

LAYERS, HEADS, DIM = 3, 2, 4


@pytest.fixture(autouse=True)
def _read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_padding, "host_padding", False)


def _layers(left_padding: list[int], length: int, seed: int) -> list[BatchKVCache]:
    """Layers of one batch: the same padding on every layer, as a model's are."""
    mx.random.seed(seed)
    rows = len(left_padding)
    out = []
    for _ in range(LAYERS):
        c = BatchKVCache(list(left_padding))
        k = mx.random.normal((rows, HEADS, length, DIM))
        c.update_and_fetch(k, k + 1)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def _state(caches: list[BatchKVCache]) -> list[tuple[Any, ...]]:
    return [
        (c.keys.tolist(), c.values.tolist(), c.offset.tolist(), c.left_padding.tolist(), c._idx)
        for c in caches
    ]


@pytest.mark.parametrize("keep", [[1, 2], [0, 2], [2], [0, 1, 2], [2, 0], [3, 1]])
def test_filtering_every_layer_at_once_is_mlx_lms_filter(keep: list[int]) -> None:
    # Row 0 is the longest (no padding): when it leaves, the rest shift left.
    ours, theirs = _layers([0, 3, 5, 1], 8, seed=1), _layers([0, 3, 5, 1], 8, seed=1)
    batch_padding._filter_layers(ours, keep)
    for c in theirs:
        c.filter(keep)
    assert _state(ours) == _state(theirs)


def test_offsets_every_layer_shares_are_gathered_once_and_stay_shared() -> None:
    """After a pass that wrote the caches in place (worker/fused.py,
    `next_offsets`) every layer holds one offset array: a filter gathers it
    once, as mlx-lm's per-layer filter would have gathered it per layer."""
    ours, theirs = _layers([0, 3, 5, 1], 8, seed=1), _layers([0, 3, 5, 1], 8, seed=1)
    shared = ours[0].offset
    for c in ours:
        c.offset = shared
    batch_padding._filter_layers(ours, [0, 2])
    for c in theirs:
        c.filter([0, 2])
    assert _state(ours) == _state(theirs)
    assert len({id(c.offset) for c in ours}) == 1


def test_kept_rows_are_one_slice_when_they_are_one_run() -> None:
    assert batch_padding._rows([1, 2, 3]) == slice(1, 4)
    assert batch_padding._rows([0]) == slice(0, 1)
    # gaps or another order: one index array, built once for every layer
    for keep in ([0, 2], [2, 1]):
        rows = batch_padding._rows(keep)
        assert isinstance(rows, mx.array) and rows.tolist() == keep


class _Batch:
    """The attributes of a batch the wrappers touch, with a stand-in for mlx-lm's method."""

    def __init__(self, caches: list[BatchKVCache]) -> None:
        self.prompt_cache = caches
        self.seen: list[Any] = []

    def filter(self, keep: list[int]) -> None:  # mlx-lm's: loops over the caches
        self.seen.append(list(self.prompt_cache))
        for c in self.prompt_cache:
            c.filter(keep)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every read-back of the padding through the guard; a layer's own is an error."""
    reads: list[int] = []
    real = batch_padding._paddings

    def counted(caches: list[Any]) -> list[list[int]]:
        reads.append(len(caches))
        return real(caches)

    def per_layer(self: Any, *args: Any) -> None:
        raise AssertionError("a layer read its padding back on its own")

    monkeypatch.setattr(batch_padding, "_paddings", counted)
    monkeypatch.setattr(BatchKVCache, "filter", per_layer)
    monkeypatch.setattr(BatchKVCache, "extract", per_layer)
    return reads


def test_a_batch_filter_reads_the_padding_back_once_for_all_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = _Batch(_layers([0, 2], 6, seed=2))
    reads = _count_reads(monkeypatch)
    batch_padding._one_read_filter(_Batch.filter)(batch, [1])
    assert reads == [LAYERS]
    assert batch.seen == [[]]  # mlx-lm's bookkeeping ran without the caches
    assert len(batch.prompt_cache) == LAYERS and batch.prompt_cache[0].keys.shape[0] == 1
    assert batch.prompt_cache[0].left_padding.tolist() == [0]  # row 1 shifted left


def test_other_cache_types_keep_mlx_lms_path() -> None:
    class Other:
        def __init__(self) -> None:
            self.filtered: list[list[int]] = []

        def filter(self, keep: list[int]) -> None:
            self.filtered.append(keep)

    layers: list[Any] = [Other(), Other()]
    batch = _Batch(layers)
    batch_padding._one_read_filter(_Batch.filter)(batch, [0])
    assert [o.filtered for o in layers] == [[[0]], [[0]]]


def test_install_wraps_mlx_lms_batches_once() -> None:
    batch_padding.install()
    first = GenerationBatch.filter
    batch_padding.install()
    assert GenerationBatch.filter is first
    assert GenerationBatch.filter.__wrapped__.__qualname__ == "GenerationBatch.filter"  # type: ignore[attr-defined]


@pytest.mark.parametrize("idx", [0, 1])
def test_extracting_a_row_with_one_read_back_is_mlx_lms_extract(
    monkeypatch: pytest.MonkeyPatch, idx: int
) -> None:
    class Batch(_Batch):
        def extract_cache(self, idx: int) -> list[Any]:  # mlx-lm's: one extract per layer
            return [c.extract(idx) for c in self.prompt_cache]

    ours, theirs = Batch(_layers([0, 3], 7, seed=3)), _layers([0, 3], 7, seed=3)
    want = [c.extract(idx) for c in theirs]
    reads = _count_reads(monkeypatch)
    got = batch_padding._one_read_extract(Batch.extract_cache)(ours, idx)
    assert reads == [LAYERS]
    assert [(g.keys.tolist(), g.values.tolist(), g.offset) for g in got] == [
        (w.keys.tolist(), w.values.tolist(), w.offset) for w in want
    ]


def _keys_and_values(caches: list[BatchKVCache]) -> list[tuple[Any, ...]]:
    """What attention reads: every row's KV up to the batch's end, and the bookkeeping."""
    return [
        (
            *(a.tolist() for a in c.keys_and_values()),
            c.offset.tolist(),
            c.left_padding.tolist(),
            c._idx,
        )
        for c in caches
    ]


@pytest.mark.parametrize(
    ("top", "bottom"),
    [
        (([0, 2], 5), ([1], 9)),  # a longer row joins shorter ones (a prompt joins decode rows)
        (([1, 0, 3], 9), ([0, 4], 3)),  # shorter rows join longer ones
        (([0], 6), ([2], 6)),  # the same length
    ],
)
def test_joining_rows_with_one_write_is_mlx_lms_extend(top: Any, bottom: Any) -> None:
    ours, theirs = _layers(*top, seed=3), _layers(*top, seed=3)
    ours_b, theirs_b = _layers(*bottom, seed=4), _layers(*bottom, seed=4)
    for a, b in zip(ours, ours_b, strict=True):
        batch_padding.one_write_extend(a, b)
    for a, b in zip(theirs, theirs_b, strict=True):
        batch_padding.MLX_LM_EXTEND(a, b)
    assert _keys_and_values(ours) == _keys_and_values(theirs)
    # the grown buffer is the longer side's (decode steps append into it)
    assert [c.keys.shape for c in ours] == [c.keys.shape for c in theirs]


def test_joining_an_empty_side_keeps_mlx_lms_path() -> None:
    ours, theirs = _layers([0, 1], 5, seed=5), _layers([0, 1], 5, seed=5)
    for a, b in zip(ours, theirs, strict=True):
        batch_padding.one_write_extend(a, BatchKVCache([0]))
        batch_padding.MLX_LM_EXTEND(b, BatchKVCache([0]))
    assert _keys_and_values(ours) == _keys_and_values(theirs)


def test_install_puts_the_one_write_join_in_place() -> None:
    batch_padding.install()
    # the one-write join, with the host's padding joined beside it
    assert BatchKVCache.extend is batch_padding.mirrored_extend


def _merged(lengths: list[int], seed: int) -> BatchKVCache:
    """One layer merged from prefix-cache entries: its buffer is the longest
    row, off the 256-slot grid (mlx-lm's BatchKVCache.merge)."""
    mx.random.seed(seed)
    entries = []
    for n in lengths:
        c = KVCache()
        k = mx.random.normal((1, HEADS, n, DIM))
        c.update_and_fetch(k, k - 1)
        entries.append(c)
    return BatchKVCache.merge(entries)


@pytest.mark.parametrize("chunks", [[300], [248, 1], [1, 1, 600], [256]])
def test_growth_stays_on_the_step_grid_with_mlx_lms_contents(chunks: list[int]) -> None:
    ours, theirs = _merged([8, 5], seed=6), _merged([8, 5], seed=6)
    assert ours.keys is not None and ours.keys.shape[2] % ours.step  # the case: off the grid
    for i, n in enumerate(chunks):
        mx.random.seed(10 + i)
        k = mx.random.normal((2, HEADS, n, DIM))
        got = batch_padding.aligned_update_and_fetch(ours, k, k * 2)
        want = batch_padding.MLX_LM_UPDATE(theirs, k, k * 2)
        assert [a.tolist() for a in got] == [a.tolist() for a in want]
        assert ours.keys.shape[2] % ours.step == 0
        assert ours.keys.shape[2] >= ours._idx == theirs._idx
        assert ours.offset.tolist() == theirs.offset.tolist()


def test_a_reserved_buffer_grows_once_to_the_reserve_with_mlx_lms_contents() -> None:
    ours, theirs = _merged([8, 5], seed=7), _merged([8, 5], seed=7)
    batch_padding.take_ahead()
    batch_padding.reserve([ours, KVCache()], 8 + 600)  # other cache types: left alone
    sizes = []
    for i in range(10):
        mx.random.seed(20 + i)
        k = mx.random.normal((2, HEADS, 60, DIM))
        got = batch_padding.aligned_update_and_fetch(ours, k, k * 3)
        want = batch_padding.MLX_LM_UPDATE(theirs, k, k * 3)
        assert [a.tolist() for a in got] == [a.tolist() for a in want]
        assert ours.keys is not None
        sizes.append(ours.keys.shape[2])
    assert sizes == [768] * 10  # one growth, to 608 slots on the grid
    # grown ahead of the first update's need (68 slots: 256) by 512 slots, keys and values
    assert batch_padding.take_ahead() == 512 * 2 * HEADS * 2 * DIM * 4
    assert batch_padding.take_ahead() == 0
    batch_padding.reserve([ours], 4096)
    batch_padding.release([ours])  # a decode batch's: forgotten
    k = mx.random.normal((2, HEADS, 300, DIM))  # past the buffer: grid growth again
    batch_padding.aligned_update_and_fetch(ours, k, k)
    assert ours.keys.shape[2] == 1024 and ours._idx == 908
    batch_padding.reserve([ours], 1500)
    batch_padding.aligned_update_and_fetch(ours, k, k)  # grows, and spends the reserve
    assert ours.keys.shape[2] == 1536 and ours._idx == 1208
    assert not hasattr(ours, batch_padding._RESERVE)  # a later shift cannot meet it stale


def test_install_puts_the_grid_growth_in_place() -> None:
    batch_padding.install()
    assert BatchKVCache.update_and_fetch is batch_padding.aligned_update_and_fetch
