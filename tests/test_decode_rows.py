"""worker/decode_rows.py: the decode batch's KV with rows in windows of their own.

Every row's keys and values, and every step's attention, are checked against
a plain record of what each row was given (`Truth`): joins shorter and longer
than the batch, rows leaving from the middle, growth ahead of need. The
generator's greedy tokens with the layout on are tests/test_fused.py's; the
last test runs it in a real worker behind a real gateway."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm.models.cache import BatchKVCache

from tests.helpers import NO_EOS, Server, start_server, stop_server
from worker import decode_rows
from worker.decode_rows import RowsKVCache

LAYERS, HEADS, QUERY_HEADS, DIM = 3, 2, 4, 8
SCALE = DIM**-0.5


class Truth:
    """Each row's keys and values per layer, as plain lists of (heads, dim) arrays."""

    def __init__(self) -> None:
        self.rows: list[list[tuple[list[mx.array], list[mx.array]]]] = []  # row -> layer -> (k, v)

    def attention(self, row: int, layer: int, q: mx.array) -> mx.array:
        k, v = self.rows[row][layer]
        keys = mx.stack(k, axis=1)[None]  # (1, heads, length, dim)
        values = mx.stack(v, axis=1)[None]
        return mx.fast.scaled_dot_product_attention(q[None], keys, values, scale=SCALE)[0]


def _prompt_batch(lengths: list[int], truth: Truth, seed: int) -> list[RowsKVCache]:
    """A prompt batch's BatchKVCache layers (left-padded), in the rows layout."""
    mx.random.seed(seed)
    longest = max(lengths)
    pad = [longest - n for n in lengths]
    first = len(truth.rows)
    truth.rows += [[([], []) for _ in range(LAYERS)] for _ in lengths]
    layers = []
    for layer in range(LAYERS):
        c = BatchKVCache(list(pad))
        k = mx.random.normal((len(lengths), HEADS, longest, DIM))
        v = mx.random.normal((len(lengths), HEADS, longest, DIM))
        c.update_and_fetch(k, v)
        layers.append(c)
        for r, p in enumerate(pad):
            tk, tv = truth.rows[first + r][layer]
            tk += [k[r, :, s] for s in range(p, longest)]
            tv += [v[r, :, s] for s in range(p, longest)]
    rows = decode_rows.as_rows(layers, pad)
    assert rows is not None
    return rows


def _step(caches: list[RowsKVCache], truth: Truth, seed: int) -> None:
    """One decode step through every layer, as a model runs it; each row's
    attention checked against its own keys alone."""
    mx.random.seed(seed)
    n = caches[0].layout.rows
    mask = caches[0].make_mask(1)
    for layer, c in enumerate(caches):
        q = mx.random.normal((n, QUERY_HEADS, 1, DIM))
        k = mx.random.normal((n, HEADS, 1, DIM))
        v = mx.random.normal((n, HEADS, 1, DIM))
        keys, values = c.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE, mask=mask)
        for r in range(n):
            truth.rows[r][layer][0].append(k[r, :, 0])
            truth.rows[r][layer][1].append(v[r, :, 0])
            want = truth.attention(r, layer, q[r])
            assert mx.allclose(out[r], want, atol=1e-5).item(), (layer, r)


def _assert_rows(caches: list[RowsKVCache], truth: Truth) -> None:
    assert caches[0].layout.rows == len(truth.rows)
    for r in range(len(truth.rows)):
        for layer, kv in enumerate(decode_rows.extract(caches, r)):
            k, v = truth.rows[r][layer]
            assert kv.offset == len(k)
            assert mx.array_equal(kv.keys[0], mx.stack(k, axis=1)).item()
            assert mx.array_equal(kv.values[0], mx.stack(v, axis=1)).item()
    offsets = caches[0].offset.tolist()
    assert offsets == [len(t[0][0]) for t in truth.rows]  # RoPE positions


def _leave(caches: list[RowsKVCache], truth: Truth, keep: list[int]) -> list[int]:
    order = decode_rows.hole_order(keep, caches[0].layout.rows)
    decode_rows.leave(caches, order)
    truth.rows = [truth.rows[r] for r in order]
    return order


@pytest.mark.parametrize("runs", [1, decode_rows.MAX_RUNS])  # 1: rows of two ends scatter
def test_rows_join_step_and_leave_as_each_row_alone_would(
    runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_rows, "MAX_RUNS", runs)
    truth = Truth()
    batch = _prompt_batch([5, 9, 2], truth, seed=1)
    assert batch[0].layout.shared_end == 9
    for i in range(3):
        _step(batch, truth, seed=10 + i)
    _assert_rows(batch, truth)
    # Shorter rows: placed to end where the batch does, so one slice still writes them.
    decode_rows.join(batch, _prompt_batch([3, 4], truth, seed=2))
    assert batch[0].layout.shared_end == 12
    _step(batch, truth, seed=20)
    # A longer row keeps its own end: two runs of rows, each written apart
    # (or by one scatter) until the ends are shared again.
    decode_rows.join(batch, _prompt_batch([30], truth, seed=3))
    assert batch[0].layout.shared_end is None
    assert [(a, b) for a, b, _ in batch[0].layout.runs] == [(0, 5), (5, 6)]
    for i in range(2):
        _step(batch, truth, seed=30 + i)
    _assert_rows(batch, truth)
    # Rows 1 and 3 leave: the last two rows fill their places, the rest stay.
    assert _leave(batch, truth, [0, 2, 4, 5]) == [0, 4, 2, 5]
    _step(batch, truth, seed=40)
    _assert_rows(batch, truth)
    # Row 0 leaves: the last row (the long one) alone moves into its place.
    assert _leave(batch, truth, [1, 2, 3]) == [3, 1, 2]
    _step(batch, truth, seed=50)
    _assert_rows(batch, truth)
    # The long row leaves: the rest share their end again.
    assert _leave(batch, truth, [1, 2]) == [2, 1]
    assert batch[0].layout.shared_end is not None
    _step(batch, truth, seed=60)
    _assert_rows(batch, truth)


def test_a_join_with_room_copies_only_the_new_rows() -> None:
    truth = Truth()
    batch = _prompt_batch([6, 6], truth, seed=4)
    batch[0].layout.reserve(4, 64)
    for i in range(4):  # room grows ahead, a share of the layers a step
        _step(batch, truth, seed=60 + i)
    shapes = [c.keys.shape for c in batch]
    assert shapes == [(4, HEADS, 256, DIM)] * LAYERS
    before = [mx.array(c.keys) for c in batch]  # the old rows, to compare after
    decode_rows.join(batch, _prompt_batch([40, 7], truth, seed=5))
    assert [c.keys.shape for c in batch] == shapes  # no growth: nothing else moved
    for c, old in zip(batch, before, strict=True):
        assert mx.array_equal(c.keys[:2, :, :10], old[:2, :, :10]).item()
    _step(batch, truth, seed=70)
    _assert_rows(batch, truth)


def test_growth_ahead_spreads_over_steps() -> None:
    layers = LAYERS * 4  # 12 layers: 3 may grow ahead in one step
    mx.random.seed(6)
    caches = []
    for _ in range(layers):
        c = BatchKVCache([0])
        c.update_and_fetch(*(mx.random.normal((1, HEADS, 4, DIM)) for _ in range(2)))
        caches.append(c)
    rows = decode_rows.as_rows(caches, [0])
    assert rows is not None
    rows[0].layout.reserve(1, 1000)
    grown = []
    for _ in range(5):
        mask = rows[0].make_mask(1)
        for c in rows:
            c.update_and_fetch(*(mx.zeros((1, HEADS, 1, DIM)) for _ in range(2)))
        assert mask.shape == (1, 1, 1, rows[0].layout.keys - 1)
        grown.append(sum(c.keys.shape[2] == 1024 for c in rows))
    assert grown == [3, 6, 9, 12, 12]


def test_rows_nearing_the_end_of_their_slots_grow_ahead_not_when_full() -> None:
    """Eight steps before the rows fill their buffers the layout asks for the
    next 256 slots, and the layers grow a quarter at a time: none grows in the
    step that needs the slot."""
    mx.random.seed(7)
    layers = []
    for _ in range(8):
        c = BatchKVCache([0, 3])
        c.update_and_fetch(*(mx.random.normal((2, HEADS, 240, DIM)) for _ in range(2)))
        layers.append(c)
    rows = decode_rows.as_rows(layers, [0, 3])
    assert rows is not None and rows[0].keys.shape[2] == 256
    forced = 0
    for _ in range(20):  # from 240 filled slots to 260
        rows[0].make_mask(1)
        for c in rows:
            short = c.keys.shape[2] < rows[0].layout.keys
            c.update_and_fetch(*(mx.zeros((2, HEADS, 1, DIM)) for _ in range(2)))
            forced += short
    assert forced == 0
    assert all(c.keys.shape[2] == 512 for c in rows)


@pytest.mark.parametrize(
    ("keep", "rows", "order"),
    [
        ([0, 1, 2], 4, [0, 1, 2]),  # the last row left: nothing moves
        ([1, 2, 3], 4, [3, 1, 2]),  # the first: the last takes its place
        ([0, 3], 4, [0, 3]),
        ([2, 3], 4, [2, 3]),
        ([4], 5, [4]),
    ],
)
def test_hole_order_moves_only_rows_past_the_new_count(
    keep: list[int], rows: int, order: list[int]
) -> None:
    assert decode_rows.hole_order(keep, rows) == order
    moved = [r for i, r in enumerate(order) if i != r]
    assert all(r >= len(keep) for r in moved)


def test_only_a_batch_of_kv_caches_with_kv_takes_the_layout() -> None:
    assert decode_rows.as_rows([BatchKVCache([0, 1])]) is None  # no KV yet
    assert decode_rows.as_rows([]) is None
    c = BatchKVCache([1, 0])
    c.update_and_fetch(mx.zeros((2, HEADS, 3, DIM)), mx.zeros((2, HEADS, 3, DIM)))
    rows = decode_rows.as_rows([c])  # padding read back when the host has none
    assert rows is not None and rows[0].layout.starts == [1, 0]
    with pytest.raises(NotImplementedError):
        rows[0].make_mask(4)


# -- through a real server ---------------------------------------------------------


@pytest.fixture(scope="module")
def rows_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("logs") / "rows.log"
    env = {"MLXD_DECODE_ROWS": "on", "MLXD_FUSED_STEP": "on"}
    srv = start_server(str(tiny_model_dir), log_path, model_name="tiny", env=env)
    yield srv
    stop_server(srv)


def _chat(client: openai.OpenAI, content: str, max_tokens: int) -> list[int]:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        logit_bias=NO_EOS,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )
    return list(r.choices[0].model_extra["token_ids"])  # type: ignore[index]


def test_a_server_with_the_rows_layout_gives_every_request_its_solo_tokens(
    rows_server: Server, server: Server
) -> None:
    """The worker keeps its decode rows in the rows layout (its log says so):
    three streams of different lengths (rows leave from the middle), a long
    prompt and a short one arriving while they decode (rows joining longer
    and shorter than the streams). Each request gets the tokens it gets
    alone from a server on mlx-lm's cache."""
    assert "decode rows on" in rows_server.log()
    rows = openai.OpenAI(base_url=rows_server.v1, api_key="x", max_retries=0, timeout=120)
    solo = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)
    streams = [(f"stream {i} " * (3 + i), 150 + 50 * i) for i in range(3)]
    later = [("a long prompt " * 120, 20), ("hi", 12)]
    want = [_chat(solo, c, n) for c, n in streams + later]
    started = threading.Barrier(4, timeout=120)

    def stream(content: str, max_tokens: int) -> list[int]:
        ids: list[int] = []
        waited = False
        for chunk in rows.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            logit_bias=NO_EOS,  # type: ignore[arg-type]
            stream=True,
            extra_body={"return_token_ids": True},
        ):
            if chunk.choices:
                ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
            if len(ids) >= 2 and not waited:  # a chunk may carry several tokens
                waited = True
                started.wait()  # every stream decodes before the others arrive
        return ids

    with ThreadPoolExecutor(5) as pool:
        running = [pool.submit(stream, c, n) for c, n in streams]
        started.wait()
        arriving = [pool.submit(_chat, rows, c, n) for c, n in later]
        got = [f.result() for f in running + arriving]
    assert got == want
    rows_server.wait_idle()
