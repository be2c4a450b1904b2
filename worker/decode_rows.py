"""The decode batch's KV cache: rows that keep their own windows, in buffers with room.

mlx-lm's BatchKVCache keeps every row right-aligned at one shared end, so a
row joins a decode batch only by laying out every row anew: when a prompt of
2,000 tokens joins 16 streams at 500, every stream's keys and values are
copied into buffers 2,000 slots long (worker/batch_padding.py,
`one_write_extend`), and a row that leaves from the middle copies every row
that stays (its gather). On an H100 (session 34, llama8b) the step a long
prompt joins in cost 27-28 ms against a 6.4-7.0 ms decode step, and it was
the streams' longest gap under mixed pressure (docs/architecture.md, "The
step a long prompt joins in").

Off by default (`decode_rows`, worker/backend.py): on an H100 (session 36,
llama8b, 16 streams) it made the join a fifth of what it was and every decode
step 12% dearer, and the step a long prompt joins in did not get shorter
(docs/architecture.md, "The decode rows' layout").

`RowsKVCache` is one layer's KV in this layout, and `Layout` the rows' windows
that all the layers of one batch share:
- Buffers (rows, KV heads, slots, head size) with room for more rows and slots
  than the batch holds. Row r keeps its tokens in slots [start_r, end_r) and
  writes its next one at end_r. Slots outside a row's window hold zeros or
  keys of rows gone, finite either way, and the mask gives them no weight
  (worker/decode_attention.py's kernel does not even read them).
- Joining rows (`join`) are copied into the free rows, as one block per array
  and layer: the new rows only. A block that ends before the batch's shared
  end is placed to end there, so the rows keep one end and each step writes
  them with one slice update, as mlx-lm does; a longer one keeps its own end,
  and steps write each run of rows that share an end with a slice update of
  its own (`MAX_RUNS`; past that, one scatter) until the ends are shared
  again.
- Leaving rows (`leave`): the batch is reordered so that rows past the new
  count fill the holes (`hole_order`). The last rows leaving move nothing;
  rows that fill holes (one slice update for one row, one scatter for
  more) cost one copy of the buffers, as mlx-lm's gather of the rows that
  stay does: MLX writes in place only into a buffer no other
  array of the graph reads, and the moved rows are read from the same
  buffer (on this CPU, one row moved in a 268 MB buffer took 96 ms, the
  buffer's copy, and a slice written from another array 0.02 ms).
- Growth: a buffer short of rows or slots grows (a copy of what it holds) to
  what the layout asks; `Layout.reserve` asks ahead (a prompt that will join,
  the slots the rows will reach) and each step then grows a quarter of the
  layers at most (`GROW_SHARE`), so no one step pays for all of them.

Only worker/fused.py makes these (FusedGenerator, `decode_rows`), from the
BatchKVCache of the prompts that finish prefilling, taking their buffers as
they are. mlx-lm's per-layer `filter` and `extend` are not for this layout:
the batch calls `leave` and `join` for all layers at once (`_Batch`).

Threading: engine thread only, like every MLX call in the worker.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.batch_padding import grew_ahead

STEP = 256  # slots a buffer grows by, BatchKVCache's step (prompt chunks pad to it)
ROW_STEP = 4  # rows a buffer grows by
# Of every layer's buffers that must grow ahead of need, this share at most
# grows in one step (1/4: a layout that asks ahead four steps or more before
# the room is needed never grows all of them in one step).
GROW_SHARE = 4
# Steps before the rows fill their slots that the next growth is asked for.
AHEAD_STEPS = 8
# Rows written by one slice update per run of rows with one end, up to this
# many runs; past it, one scatter. MLX builds a scatter from about twenty
# primitives a layer (index broadcasts and casts), a run's slice update from
# two. Counted as `bench.pacing_probe --count-ops` counts (thin32 on this
# CPU, session 35), a fused decode step of 16 rows and a longer one that
# joined them: 3,948 primitives by scatter, 3,499 by runs, 3,370 with
# mlx-lm's cache (the rows aligned at the longer end); 16 rows with one end
# 3,305 against mlx-lm's 3,368 (one RoPE offset a step, not one a layer).
MAX_RUNS = 4


def _round(n: int, step: int) -> int:
    return -(-n // step) * step


class Layout:
    """The rows' windows, shared by every layer of one decode batch (module doc).

    `starts` and `ends` (host) are each row's first slot and the slot its next
    token goes to, as they stand before the step in progress writes. `offset`
    (device) is each row's position, for RoPE. A step advances them once
    its last layer has written (`wrote`)."""

    def __init__(self, layers: int, starts: list[int], ends: list[int], offset: mx.array) -> None:
        self.layers = layers
        self.starts, self.ends = starts, ends
        self.offset = offset
        self.rows_room = len(starts)  # the rows the layers' buffers are to hold
        self.slots_room = 0  # the slots (set by the first layer's buffer)
        self._written = 0  # layers written in the step in progress
        self._grown = 0  # layers grown ahead in the step in progress
        self._changed()

    def _changed(self) -> None:
        """Rows joined or left: everything derived from the windows anew."""
        # (first row, row past the last, end) of each run of rows with one end
        self.runs: list[tuple[int, int, int]] = []
        for row, end in enumerate(self.ends):
            if self.runs and self.runs[-1][2] == end:
                self.runs[-1] = (self.runs[-1][0], row + 1, end)
            else:
                self.runs.append((row, row + 1, end))
        # On the device, made from the host's lists only when rows join or leave:
        # MLX's CUDA backend (v0.32) allocates an array made from host data with
        # no stream, in unified memory, with a synchronous copy when its cache
        # hands back a device buffer (bench.alloc_probe --host-arrays).
        self._starts: mx.array | None = None
        self._ends: mx.array | None = None  # advanced by one a step on the device
        self._stepped()

    def _stepped(self) -> None:
        self._mask: mx.array | None = None
        self._index: tuple[mx.array, mx.array] | None = None

    @property
    def shared_end(self) -> int | None:
        """The end every row shares, if they share one."""
        return self.runs[0][2] if len(self.runs) == 1 else None

    @property
    def rows(self) -> int:
        return len(self.starts)

    @property
    def keys(self) -> int:
        """The slots a step's attention reads (its own token's included)."""
        return max(self.ends) + 1

    def mask(self) -> mx.array:
        """(rows, 1, 1, keys): each row's window and the slot it writes now."""
        if self._mask is None:
            starts, ends = self._windows()
            slot = mx.arange(self.keys)
            inside = (slot >= starts[:, None]) & (slot <= ends[:, None])
            self._mask = inside.reshape(self.rows, 1, 1, self.keys)
        return self._mask

    def index(self) -> tuple[mx.array, mx.array]:
        """The rows and the slots a step's scatter writes (ends not shared)."""
        if self._index is None:
            self._index = (mx.arange(self.rows), self._windows()[1])
        return self._index

    def _windows(self) -> tuple[mx.array, mx.array]:
        """`starts` and `ends` on the device (see `_changed`)."""
        if self._starts is None or self._ends is None:
            self._starts, self._ends = mx.array(self.starts), mx.array(self.ends)
        return self._starts, self._ends

    def reserve(self, rows: int, slots: int) -> None:
        """Ask the layers' buffers to hold `rows` rows of `slots` slots (at least
        what they hold), grown ahead, a few layers a step (module doc)."""
        self.rows_room = max(self.rows_room, _round(rows, ROW_STEP))
        self.slots_room = max(self.slots_room, _round(slots, STEP))

    def may_grow_ahead(self) -> bool:
        """Whether one more layer may grow ahead of need in this step."""
        if self._grown >= max(1, self.layers // GROW_SHARE):
            return False
        self._grown += 1
        return True

    def wrote(self) -> None:
        """A layer wrote this step's tokens; after the last one, the step is done."""
        self._written += 1
        if self._written < self.layers:
            return
        self._written = self._grown = 0
        self.ends = [e + 1 for e in self.ends]
        self.runs = [(first, past, end + 1) for first, past, end in self.runs]
        self.offset = self.offset + 1
        if self._ends is not None:
            self._ends = self._ends + 1
        self._stepped()
        if self.keys + AHEAD_STEPS > self.slots_room:
            self.reserve(self.rows, self.slots_room + STEP)


class RowsKVCache:
    """One layer's KV of a decode batch in the rows layout (module docstring)."""

    def __init__(self, layout: Layout, keys: mx.array, values: mx.array) -> None:
        self.layout = layout
        self.keys, self.values = keys, values
        layout.slots_room = max(layout.slots_room, int(keys.shape[2]))

    @property
    def offset(self) -> mx.array:
        return self.layout.offset

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def make_mask(self, n: int, return_array: bool = False, window_size: Any = None) -> mx.array:
        if n != 1 or window_size is not None:
            raise NotImplementedError("a decode batch's rows take one token a step")
        return self.layout.mask()

    def fit(self, rows: int, slots: int) -> None:
        """Grow the buffers, if short, to hold `rows` rows of `slots` slots, and
        while growing, to the room the layout asks for; what they hold is kept."""
        lay = self.layout
        have_rows, have_slots = int(self.keys.shape[0]), int(self.keys.shape[2])
        short = have_rows < rows or have_slots < slots
        ahead = have_rows < lay.rows_room or have_slots < lay.slots_room
        if not short and not (ahead and lay.may_grow_ahead()):
            return
        grown_rows = max(rows, lay.rows_room, have_rows)
        grown_slots = max(slots, lay.slots_room, have_slots)
        used = max(lay.ends, default=0)
        held = min(lay.rows, have_rows)

        def grown(a: mx.array) -> mx.array:
            out = mx.zeros((grown_rows, a.shape[1], grown_slots, a.shape[3]), a.dtype)
            if held and used:
                out[:held, :, :used] = a[:held, :, :used]
            return out

        before = self.nbytes
        self.keys, self.values = grown(self.keys), grown(self.values)
        # live state, not the step's scratch (Runner.step)
        grew_ahead(self.nbytes - before)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        lay = self.layout
        n, length = lay.rows, lay.keys
        if keys.shape[2] != 1 or keys.shape[0] != n:
            raise NotImplementedError("a decode batch's rows take one token a step")
        self.fit(n, length)
        if len(lay.runs) <= MAX_RUNS:
            for first, past, end in lay.runs:
                whole = first == 0 and past == n
                self.keys[first:past, :, end : end + 1] = keys if whole else keys[first:past]
                self.values[first:past, :, end : end + 1] = values if whole else values[first:past]
        else:
            rows, slots = lay.index()
            self.keys[rows, :, slots] = keys[:, :, 0]
            self.values[rows, :, slots] = values[:, :, 0]
        out = self.keys[:n, :, :length], self.values[:n, :, :length]
        lay.wrote()
        return out


def takes(caches: list[Any]) -> bool:
    """Whether `as_rows` takes these layers: BatchKVCache, each with KV in it."""
    return bool(caches) and all(type(c) is BatchKVCache and c.keys is not None for c in caches)


def as_rows(caches: list[Any], starts: list[int] | None = None) -> list[RowsKVCache] | None:
    """The rows layout over a batch's BatchKVCache layers, their buffers taken as
    they are (no copy); None where a layer is not one with KV in it. `starts`:
    the rows' left padding where the host keeps it (else one read-back)."""
    if not takes(caches):
        return None
    first = caches[0]
    if starts is None:
        starts = [int(p) for p in first.left_padding.tolist()]
    layout = Layout(len(caches), list(starts), [first._idx] * len(starts), first.offset)
    return [RowsKVCache(layout, c.keys, c.values) for c in caches]


def join(mine: list[RowsKVCache], theirs: list[RowsKVCache]) -> None:
    """Add `theirs`' rows after `mine`'s: each layer's new rows copied in as one
    block per array (module docstring)."""
    lay, other = mine[0].layout, theirs[0].layout
    n, m = lay.rows, other.rows
    used = max(other.ends)
    # Ending at the shared end where it can, so steps keep writing one slice.
    shift = 0
    if lay.shared_end is not None and other.shared_end is not None:
        shift = max(0, lay.shared_end - other.shared_end)
    rows, slots = n + m, max(lay.keys, shift + used + 1)
    lay.reserve(rows, slots)
    for mc, tc in zip(mine, theirs, strict=True):
        mc.fit(rows, slots)
        mc.keys[n:rows, :, shift : shift + used] = tc.keys[:m, :, :used]
        mc.values[n:rows, :, shift : shift + used] = tc.values[:m, :, :used]
    lay.starts = lay.starts + [s + shift for s in other.starts]
    lay.ends = lay.ends + [e + shift for e in other.ends]
    lay.offset = mx.concatenate([lay.offset, other.offset])
    lay._changed()


def hole_order(keep: list[int], rows: int) -> list[int]:
    """`keep` (the rows that stay, ascending) reordered so the rows already
    inside the new count stay where they are and the ones past it fill the
    holes: only those move."""
    count, kept = len(keep), set(keep)
    tail = [r for r in keep if r >= count]
    tail.reverse()
    return [r if r in kept else tail.pop() for r in range(count)] if count < rows else keep


def leave(caches: list[RowsKVCache], order: list[int]) -> None:
    """Keep the rows `order` names, in that order (not empty; `hole_order`'s,
    so that few move; with any move, MLX copies each buffer once: module
    docstring)."""
    lay = caches[0].layout
    moves = [(to, row) for to, row in enumerate(order) if to != row]
    used = max(lay.ends)
    # Each write copies the buffer (module docstring): one move is one slice
    # update, several are one scatter, never one update each.
    if len(moves) == 1:
        ((to, row),) = moves
        for c in caches:
            c.keys[to : to + 1, :, :used] = c.keys[row : row + 1, :, :used]
            c.values[to : to + 1, :, :used] = c.values[row : row + 1, :, :used]
    elif moves:
        to_rows = mx.array([t for t, _ in moves])
        from_rows = mx.array([r for _, r in moves])
        for c in caches:
            c.keys[to_rows, :, :used] = c.keys[from_rows, :, :used]
            c.values[to_rows, :, :used] = c.values[from_rows, :, :used]
    same = order == list(range(len(order)))
    lay.starts = [lay.starts[r] for r in order]
    lay.ends = [lay.ends[r] for r in order]
    lay.offset = lay.offset[: len(order)] if same else lay.offset[mx.array(order)]
    lay._changed()


def extract(caches: list[RowsKVCache], row: int) -> list[KVCache]:
    """Row `row`'s KV, one KVCache a layer (what BatchKVCache.extract gives)."""
    lay = caches[0].layout
    start, end = lay.starts[row], lay.ends[row]
    out = []
    for c in caches:
        cache = KVCache()
        cache.keys = mx.contiguous(c.keys[row : row + 1, :, start:end])
        cache.values = mx.contiguous(c.values[row : row + 1, :, start:end])
        cache.offset = end - start
        out.append(cache)
    return out


def is_rows(caches: Any) -> bool:
    return bool(caches) and isinstance(caches[0], RowsKVCache)
