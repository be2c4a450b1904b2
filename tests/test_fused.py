"""worker/fused.py: one forward pass for decode rows and a prompt chunk.

The fused pass must compute what the model's own forward computes: per group
against the model (llama, qwen2, qwen3 blocks), and end to end as greedy
tokens against mlx-lm's own BatchGenerator on the tiny test model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load

import worker.fused as fused_module
from protocol.messages import Add
from tests.worker_helpers import GREEDY, SMALL_BLOCK, run_to_completion, tokens_of
from worker import batch_padding, decode_rows
from worker.core import EngineCore
from worker.decode_rows import RowsKVCache
from worker.fused import (
    FusedGenerator,
    fused_hidden,
    logits_of,
    pass_rows,
    prompt_hidden_at,
    supports_fusion,
)
from worker.runner import Runner
from worker.scheduler import SchedulerConfig

COMMON = SMALL_BLOCK


def _model(kind: str) -> Any:
    mx.random.seed(3)
    if kind == "llama":
        m = llama.Model(llama.ModelArgs(model_type="llama", **COMMON, tie_word_embeddings=False))
    elif kind == "qwen2":
        m = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **COMMON))
    else:
        m = qwen3.Model(
            qwen3.ModelArgs(
                model_type="qwen3",
                **COMMON,
                max_position_embeddings=4096,
                head_dim=16,
                tie_word_embeddings=True,
                rope_theta=10000.0,
            )
        )
    mx.eval(m.parameters())
    return m


def _caches(model: Any, left_padding: list[int]) -> list[BatchKVCache]:
    return [BatchKVCache(left_padding) for _ in model.model.layers]


def _primed_twice(model: Any, history: mx.array, left_padding: list[int]) -> tuple[list, list]:
    """Two identical sets of caches holding `history`."""
    a, b = _caches(model, left_padding), _caches(model, left_padding)
    model(history, cache=a)
    model(history, cache=b)
    return a, b


def _assert_same_caches(ours: list[Any], theirs: list[Any]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        (ka, va), (kb, vb) = a.keys_and_values(), b.keys_and_values()
        assert mx.allclose(ka, kb, atol=1e-5).item() and mx.allclose(va, vb, atol=1e-5).item()


def _tokens(rows: int, length: int, salt: int) -> mx.array:
    return mx.array([[(7 * r + 13 * j + salt) % 300 for j in range(length)] for r in range(rows)])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_one_group_is_the_models_own_forward(kind: str) -> None:
    model = _model(kind)
    assert supports_fusion(model)
    tokens = _tokens(2, 9, 1)
    own = model(tokens, cache=_caches(model, [0, 3]))
    (hidden,) = fused_hidden(model, [(tokens, _caches(model, [0, 3]))])
    assert mx.allclose(logits_of(model, hidden), own, atol=1e-5).item()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_decode_rows_and_a_chunk_in_one_pass_match_two_passes(kind: str) -> None:
    model = _model(kind)
    separate, fused = _primed_twice(model, _tokens(3, 6, 2), [0, 1, 2])
    step = _tokens(3, 1, 5)
    chunk = _tokens(1, 11, 9)
    chunk_separate, chunk_fused = _caches(model, [0]), _caches(model, [0])

    decode_logits = model(step, cache=separate)
    model(chunk, cache=chunk_separate)
    decode_h, _ = fused_hidden(model, [(step, fused), (chunk, chunk_fused)])

    assert mx.allclose(logits_of(model, decode_h), decode_logits, atol=1e-5).item()
    _assert_same_caches(chunk_separate + separate, chunk_fused + fused)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_prompt_pass_gives_the_models_own_hidden_state_at_each_end(kind: str) -> None:
    """A history in left-padded caches, then a right-padded chunk: the hidden
    states `prompt_hidden_at` gives at the rows' last real tokens, and every
    layer's cache after it, are the model's own forward's."""
    model = _model(kind)
    own, ours = _primed_twice(model, _tokens(3, 5, 4), [0, 2, 1])
    chunk = _tokens(3, 7, 8)
    lengths = [7, 4, 6]  # rows 1 and 2 are right-padded, as _pad_chunks pads them
    for c in own + ours:
        c.prepare(lengths=lengths, right_padding=[7 - n for n in lengths])
    hidden = model.model(chunk, cache=own)
    ends = [(0, 6), (2, 5)]  # rows 0 and 2 end here; row 1 goes on
    at = prompt_hidden_at(model, chunk, ours, ends)
    assert at.shape == (2, 1, hidden.shape[-1])
    for i, (r, c) in enumerate(ends):
        assert mx.allclose(at[i, 0], hidden[r, c], atol=1e-5).item()
    for c in own + ours:
        c.finalize()
    _assert_same_caches(own, ours)
    assert all(a.offset.tolist() == b.offset.tolist() for a, b in zip(own, ours, strict=True))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_padded_pass_gives_the_unpadded_pass_s_states_and_caches(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero rows after the groups' tokens (3 decode rows + 11 chunk tokens run
    as 32 rows), and the chunk's attention over the cache's whole buffer (256
    keys, 245 masked) with its 11 queries padded to 32, change no group's
    hidden states and no cache."""
    padded_attention: list[tuple[int, ...]] = []
    original = fused_module._padded

    def spy(q: mx.array, mask: mx.array, cache: Any, masks: Any = None) -> Any:
        out = original(q, mask, cache, masks)
        padded_attention.append((*out[0].shape[2:3], *out[1].shape[2:3], *out[3].shape[-2:]))
        return out

    monkeypatch.setattr(fused_module, "_padded", spy)
    model = _model(kind)
    plain, padded = _primed_twice(model, _tokens(3, 6, 2), [0, 1, 2])
    step, chunk = _tokens(3, 1, 5), _tokens(1, 11, 9)
    chunk_plain, chunk_padded = _caches(model, [0]), _caches(model, [0])
    ours = fused_hidden(model, [(step, padded), (chunk, chunk_padded)], pad_rows=True)
    theirs = fused_hidden(model, [(step, plain), (chunk, chunk_plain)])
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()
    _assert_same_caches(chunk_padded + padded, chunk_plain + plain)
    # every layer's chunk: (queries, keys, mask rows, mask keys); the decode rows unpadded
    assert padded_attention == [(32, 256, 32, 256)] * len(model.model.layers)


def test_a_padded_pass_pads_its_chunk_mask_once_for_every_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer's cache holds the same rows, so the chunk's padded mask is
    the same at every layer: built once a pass (on a GPU each copy is a
    kernel launch, and a small pass is bound by its launches)."""
    built: list[tuple[int, ...]] = []
    original = fused_module._padded_mask

    def spy(mask: mx.array, keys: int, queries: int) -> mx.array:
        out = original(mask, keys, queries)
        built.append(tuple(out.shape[-2:]))
        return out

    monkeypatch.setattr(fused_module, "_padded_mask", spy)
    model = _model("llama")
    assert len(model.model.layers) > 1
    _, padded = _primed_twice(model, _tokens(3, 6, 2), [0, 1, 2])
    fused_hidden(
        model, [(_tokens(3, 1, 5), padded), (_tokens(1, 11, 9), _caches(model, [0]))], pad_rows=True
    )
    assert built == [(32, 256)]


def test_a_chunk_over_an_off_grid_buffer_attends_at_the_grid_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache whose buffer a filter shifted left (250 slots, 20 filled): the
    chunk fits without growth, and its attention still runs over 256 keys
    (the buffer padded onto the step grid), with the unpadded pass's states
    and caches."""
    keys: list[int] = []
    original = fused_module._padded

    def spy(q: mx.array, mask: mx.array, cache: Any, masks: Any = None) -> Any:
        out = original(q, mask, cache, masks)
        keys.append(out[1].shape[2])
        return out

    monkeypatch.setattr(fused_module, "_padded", spy)
    model = _model("llama")
    plain, padded = _primed_twice(model, _tokens(1, 26, 3), [6])
    for c in plain + padded:  # what BatchKVCache.filter does once no row needs the padding
        c.keys, c.values = c.keys[..., 6:, :], c.values[..., 6:, :]
        c._idx -= 6
        c.left_padding -= 6
    assert all(c.keys.shape[2] == 250 for c in padded)
    chunk = _tokens(1, 11, 9)
    (ours,) = fused_hidden(model, [(chunk, padded)], pad_rows=True)
    (theirs,) = fused_hidden(model, [(chunk, plain)])
    assert mx.allclose(ours, theirs, atol=1e-5).item()
    _assert_same_caches(padded, plain)
    assert keys == [256] * len(model.model.layers)


def test_pass_rows_round_up_to_few_sizes() -> None:
    assert [pass_rows(n) for n in (1, 32, 33, 256, 257, 1000, 1025, 2049, 4097)] == [
        32,
        32,
        64,
        256,
        320,
        1024,
        1152,
        2304,
        4608,
    ]
    sizes = {pass_rows(n) for n in range(1, 2048 + 64 + 1)}
    assert len(sizes) == 29  # every pass of a 2,048-token chunk beside 64 decode rows
    assert all(pass_rows(n) - n < max(32, n // 4) for n in range(1, 5000))


def test_other_families_keep_two_passes() -> None:
    class NotFusable:
        model_type = "gemma"

    assert not supports_fusion(NotFusable())
    sliding = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            **COMMON,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        )
    )
    assert not supports_fusion(sliding)


def _run(
    gen: Any,
    arrivals: dict[int, list[list[int]]],
    max_tokens: int,
    first: dict[int, int] | None = None,
    finish: dict[int, str] | None = None,
    limits: dict[int, int] | None = None,
) -> dict[int, list[int]]:
    """Drive a generator: at step k insert arrivals[k]; collect every row's tokens
    (and, into `first`, the step that gave each row its first token, into
    `finish` each row's finish reason; `limits`: other max tokens by arrival)."""
    out: dict[int, list[int]] = {}
    names: dict[int, int] = {}
    live: set[int] = set()
    order = 0
    for k in range(400):
        for prompt in arrivals.get(k, []):
            (uid,) = gen.insert([prompt], max_tokens=[(limits or {}).get(order, max_tokens)])
            names[uid] = order
            order += 1
            live.add(uid)
        if not live and k > max(arrivals):
            break
        _, responses = gen.next()
        for r in responses:
            if first is not None:
                first.setdefault(names[r.uid], k)
            out.setdefault(names[r.uid], []).append(int(r.token))
            if r.finish_reason is not None:
                assert r.uid in live, "a token after the row finished"
                live.discard(r.uid)
                if finish is not None:
                    finish[names[r.uid]] = r.finish_reason
    return out


# Streams decode while prompts of several chunks arrive (step -> prompts).
ARRIVALS = {
    0: [[(3 * j + 1) % 500 + 3 for j in range(12)], [(5 * j + 2) % 500 + 3 for j in range(7)]],
    3: [[(11 * j + 4) % 500 + 3 for j in range(90)]],
    4: [[(13 * j + 5) % 500 + 3 for j in range(41)], [(2 * j + 9) % 500 + 3 for j in range(5)]],
    20: [[(17 * j + 6) % 500 + 3 for j in range(70)]],
}
GENERATOR_SIZES: dict[str, Any] = dict(
    stop_tokens=[], completion_batch_size=8, prefill_batch_size=4, prefill_step_size=16
)


def test_fused_generator_greedy_equals_mlx_lms_batch_generator(tiny_model_dir: Path) -> None:
    """Streams decode while prompts of several chunks arrive: the fused steps
    produce mlx-lm's greedy tokens for every request."""
    model = load(str(tiny_model_dir))[0]
    arrivals, kw = ARRIVALS, GENERATOR_SIZES
    reference = _run(BatchGenerator(model, **kw), arrivals, 24)
    fused_gen = FusedGenerator(model, fuse=True, **kw)
    assert fused_gen.fuse
    fused = _run(fused_gen, arrivals, 24)
    assert fused_gen.fused_steps >= 8  # the long prompts' chunks rode with decode rows
    assert fused == reference
    assert all(len(t) == 24 for t in fused.values())


@pytest.mark.parametrize(("fuse", "rows"), [(False, False), (True, False), (True, True)])
def test_padded_passes_give_mlx_lms_greedy_tokens(
    tiny_model_dir: Path, fuse: bool, rows: bool
) -> None:
    """Every pass padded to `pass_rows` (the CUDA setting), fused or not, the
    decode rows in worker/decode_rows.py's layout or not: the same greedy
    tokens as mlx-lm's BatchGenerator."""
    model = load(str(tiny_model_dir))[0]
    arrivals, kw = ARRIVALS, GENERATOR_SIZES
    reference = _run(BatchGenerator(model, **kw), arrivals, 24)
    gen = FusedGenerator(model, fuse=fuse, pad_rows=True, rows=rows, **kw)
    assert gen.pad_rows and gen.chunk_start and gen.decode_rows == rows
    assert _run(gen, arrivals, 24) == reference
    assert (gen.fused_steps >= 8) == fuse


@pytest.mark.parametrize("fuse", [False, True])
def test_decode_rows_give_mlx_lms_greedy_tokens_as_rows_join_and_leave_in_place(
    tiny_model_dir: Path, fuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode batch in worker/decode_rows.py's layout: prompts that join
    the streams (some ending before the streams' end, some after it, so that
    steps write the rows' runs apart), rows that leave from the middle (the
    last ones moved into their places), a request removed while it decodes;
    mlx-lm's greedy tokens for every request."""
    model = load(str(tiny_model_dir))[0]
    arrivals = {**ARRIVALS, 30: LONG_ARRIVALS[2], 31: [[5, 6, 7]]}
    reference = _run(BatchGenerator(model, **GENERATOR_SIZES), arrivals, 24)
    seen: dict[str, int] = {"joins": 0, "moved": 0, "two_ends": 0}
    join, leave, update = decode_rows.join, decode_rows.leave, RowsKVCache.update_and_fetch

    def counted_join(mine: Any, theirs: Any) -> None:
        seen["joins"] += 1
        join(mine, theirs)

    def counted_leave(caches: Any, order: list[int]) -> None:
        seen["moved"] += sum(i != r for i, r in enumerate(order))
        leave(caches, order)

    def counted_update(self: Any, k: Any, v: Any) -> Any:
        seen["two_ends"] += self.layout.shared_end is None
        return update(self, k, v)

    monkeypatch.setattr(decode_rows, "join", counted_join)
    monkeypatch.setattr(decode_rows, "leave", counted_leave)
    monkeypatch.setattr(RowsKVCache, "update_and_fetch", counted_update)
    gen = FusedGenerator(model, fuse=fuse, rows=True, **dict(GENERATOR_SIZES))
    assert gen.decode_rows
    assert _run(gen, arrivals, 24) == reference
    assert seen["joins"] >= 3 and seen["moved"] >= 2 and seen["two_ends"] > 0
    assert decode_rows.is_rows(gen._generation_batch.prompt_cache) or not len(gen._generation_batch)
    # A row removed while it decodes (an abort): its KV as it stands, and the
    # row that stays, moved into its place, goes on with mlx-lm's tokens.
    pair = ARRIVALS[0]
    want = _run(BatchGenerator(model, **GENERATOR_SIZES), {0: pair}, 12)[1]
    gone, kept = gen.insert(pair, max_tokens=[12, 12])
    got: list[int] = []
    while len(gen._generation_batch) < 2 or len(got) < 3:
        got += [int(r.token) for r in gen.next()[1] if r.uid == kept]
    moved = seen["moved"]
    ((cache, tokens),) = gen.remove([gone], return_prompt_caches=True).values()
    assert seen["moved"] == moved + 1 and gen._generation_batch.uids == [kept]
    assert all(c.offset == len(tokens) for c in cache)
    while len(gen._generation_batch):
        got += [int(r.token) for r in gen.next()[1] if r.uid == kept]
    assert got == want


# Two streams decode while a prompt of ten 64-token chunks arrives.
LONG_ARRIVALS = {
    0: [[(3 * j + 1) % 500 + 3 for j in range(12)], [(5 * j + 2) % 500 + 3 for j in range(9)]],
    2: [[(7 * j + 3) % 500 + 3 for j in range(600)]],
}


@pytest.mark.parametrize("pad_rows", [False, True])
def test_a_paced_prompt_grows_its_kv_buffer_once(tiny_model_dir: Path, pad_rows: bool) -> None:
    """A long prompt paced in small chunks beside decoding streams fills one
    buffer allocated at its first chunk for the whole prompt (worker/
    batch_padding.py, `reserve`), not one that grows by 256 slots, each growth
    a copy of every layer's keys and values; the tokens are mlx-lm's."""
    batch_padding.install()  # as the Runner does: the grid growth that honours the reserve
    model = load(str(tiny_model_dir))[0]
    kw = dict(GENERATOR_SIZES, prefill_step_size=64)
    reference = _run(BatchGenerator(model, **kw), LONG_ARRIVALS, 12)
    gen = FusedGenerator(model, fuse=True, pad_rows=pad_rows, **kw)
    buffers: list[int] = []
    real_next = gen.next

    def next_noting_the_prompt_buffer() -> Any:
        out = real_next()
        caches = gen._prompt_batch.prompt_cache
        if caches and caches[0].keys is not None:
            buffers.append(int(caches[0].keys.shape[2]))
        return out

    gen.next = next_noting_the_prompt_buffer  # type: ignore[method-assign]
    assert _run(gen, LONG_ARRIVALS, 12) == reference
    assert len(buffers) >= 8  # the prompt was paced over many steps
    assert set(buffers) == {768}  # 600 slots on the 256-slot grid, from the first chunk


def test_warming_the_pass_sizes_runs_every_padded_and_decode_size(tiny_model_dir: Path) -> None:
    assert Runner(tiny_model_dir, max_batch=4, prefill_batch=2, prefill_chunk=64).warm_shapes() == 0
    runner = Runner(tiny_model_dir, max_batch=4, prefill_batch=2, prefill_chunk=64, pad_rows=True)
    # decode batches of 1-4 rows, passes padded to 32, 64, 96 (a 64-token chunk
    # beside 4 rows), and 32- and 64-token chunks' attention over 256, ... 4,096 keys
    assert runner.info.context_length >= 4096
    assert runner.warm_shapes() == 4 + 3 + 2 * 16


def test_early_join_gives_mlx_lms_tokens_one_step_sooner(tiny_model_dir: Path) -> None:
    """Two passes, joined early: rows that finished prefilling join the decode
    batch before its pass, so each request's first token comes out one
    next() sooner than in mlx-lm's order, and every token is the same."""
    model = load(str(tiny_model_dir))[0]
    arrivals, kw = ARRIVALS, GENERATOR_SIZES
    ref_first: dict[int, int] = {}
    reference = _run(BatchGenerator(model, **kw), arrivals, 24, ref_first)
    early_gen = FusedGenerator(model, fuse=False, chunk_start=False, **kw)
    assert early_gen.early_join and not early_gen.fuse
    early_first: dict[int, int] = {}
    assert _run(early_gen, arrivals, 24, early_first) == reference
    assert early_gen.fused_steps == 0
    assert {r: ref_first[r] - 1 for r in ref_first} == early_first


def _count_passes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every forward pass, by kind: "model" (the llama body, the tiny model's),
    "hand-over" (one inside GenerationBatch's constructor: mlx-lm's pass over
    the new rows' last prompt tokens), "prompt" (`prompt_hidden_at`) and
    "fused" (`fused_hidden` over decode rows and a chunk) and "one group"
    (`fused_hidden` over either alone: `lean_decode`, or a padded prompt pass)."""
    kinds: list[str] = []
    constructing = [False]
    body, start = llama.LlamaModel.__call__, GenerationBatch.__init__

    def model_pass(self: Any, *args: Any, **kw: Any) -> mx.array:
        kinds.append("hand-over" if constructing[0] else "model")
        return body(self, *args, **kw)

    def construct(self: Any, *args: Any, **kw: Any) -> None:
        constructing[0] = True
        try:
            start(self, *args, **kw)
        finally:
            constructing[0] = False

    def counted(kind: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            kinds.append(kind)
            return fn(*args, **kw)

        return wrapper

    monkeypatch.setattr(llama.LlamaModel, "__call__", model_pass)
    monkeypatch.setattr(GenerationBatch, "__init__", construct)
    monkeypatch.setattr(fused_module, "prompt_hidden_at", counted("prompt", prompt_hidden_at))

    def fused(model: Any, groups: list[Any], *args: Any) -> Any:
        kinds.append("fused" if len(groups) > 1 else "one group")
        return fused_hidden(model, groups, *args)

    monkeypatch.setattr(fused_module, "fused_hidden", fused)
    return kinds


@pytest.mark.parametrize("fuse", [False, True])
def test_chunk_start_samples_the_first_token_from_the_prompts_own_pass(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, fuse: bool
) -> None:
    """A prompt's last chunk takes its last token too, and the first token is
    sampled from that pass's logits: mlx-lm's greedy tokens, none of mlx-lm's
    passes over only the last prompt tokens, fewer passes in all, and (two
    passes) every first token two next() sooner than mlx-lm gives it."""
    model = load(str(tiny_model_dir))[0]
    arrivals, kw = ARRIVALS, GENERATOR_SIZES
    passes = _count_passes(monkeypatch)
    ref_first: dict[int, int] = {}
    reference = _run(BatchGenerator(model, **kw), arrivals, 24, ref_first)
    ref_passes, passes[:] = list(passes), []
    gen = FusedGenerator(model, fuse=fuse, **kw)
    assert gen.chunk_start
    first: dict[int, int] = {}
    assert _run(gen, arrivals, 24, first) == reference
    assert ref_passes.count("hand-over") > 0 and passes.count("hand-over") == 0
    assert passes.count("prompt") > 0 and len(passes) < len(ref_passes)
    if not fuse:
        # the same chunk and decode passes; only mlx-lm's hand-overs are gone
        assert len(passes) == len(ref_passes) - ref_passes.count("hand-over")
        assert {r: ref_first[r] - 2 for r in ref_first} == first
    else:
        assert passes.count("fused") == gen.fused_steps > 0
        # lean_decode: the decode-only steps' passes are fused_hidden's too
        assert passes.count("one group") > 0
        assert all(first[r] <= ref_first[r] - 1 for r in ref_first)


@pytest.mark.parametrize("layout", [{}, {"pad_rows": True}, {"rows": True}])
@pytest.mark.parametrize("max_tokens", [1, 2, 24])
def test_join_read_gives_a_fused_prompts_first_token_in_its_last_chunks_step(
    tiny_model_dir: Path, max_tokens: int, layout: dict[str, bool]
) -> None:
    """With `join_read`, a prompt that finishes in a fused step reports its first
    token in that step, one next() sooner than without, and the next step's
    report leaves it out: mlx-lm's greedy tokens and finish reasons, each token
    once, also for rows that finish at their first token or their second, and
    for one that meets a stop token; with padded passes and with the decode
    rows' layout too."""
    model = load(str(tiny_model_dir))[0]
    arrivals, kw = ARRIVALS, GENERATOR_SIZES
    limits = {0: 40, 1: 40}  # the first two decode while the others arrive
    late_first: dict[int, int] = {}
    plain = FusedGenerator(model, fuse=True, **layout, **kw)
    late = _run(plain, arrivals, max_tokens, late_first, None, limits)
    # a stop token: the third token of the row whose prompt is longest (fused);
    # and its first token twice, which a matcher moved twice by that one
    # token would take for a stop
    stop = late[2][2] if max_tokens == 24 else None
    stops = {"stop_tokens": [[stop], [late[2][0]] * 2]} if stop is not None else {}
    ref_finish: dict[int, str] = {}
    ref_gen = BatchGenerator(model, **{**kw, **stops})
    reference = _run(ref_gen, arrivals, max_tokens, None, ref_finish, limits)
    gen = FusedGenerator(model, fuse=True, join_read=True, **layout, **{**kw, **stops})
    first: dict[int, int] = {}
    finish: dict[int, str] = {}
    assert _run(gen, arrivals, max_tokens, first, finish, limits) == reference
    assert finish == ref_finish and gen.fused_steps > 0
    if stop is not None:
        assert "stop" in finish.values() and "length" in finish.values()
    else:
        assert late == reference
    sooner = [r for r in first if first[r] < late_first[r]]
    assert all(first[r] == late_first[r] - 1 for r in sooner)
    assert all(first[r] == late_first[r] for r in first if r not in sooner)
    assert len(sooner) >= 3  # the prompts that ended beside decode rows


# A lone prompt on an idle generator, one arriving at the next step (while the
# first row's pass is still to be built) and one after the batch has emptied.
IDLE_ARRIVALS = {
    0: [[(3 * j + 1) % 500 + 3 for j in range(12)]],
    1: [[(5 * j + 2) % 500 + 3 for j in range(20)]],
    30: [[(7 * j + 4) % 500 + 3 for j in range(9)]],
}


@pytest.mark.parametrize("fuse", [False, True])
def test_an_idle_generator_reads_the_first_token_before_building_the_next_pass(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, fuse: bool
) -> None:
    """Nothing decoding: the step that finishes a prompt reads its first token
    right after the prompt pass, and the pass over that token is built in the
    next step, beside the one over the token after it. mlx-lm's greedy tokens,
    also when a prompt arrives in between (joined or fused) or the batch
    empties and starts again."""
    model = load(str(tiny_model_dir))[0]
    kw = GENERATOR_SIZES
    reference = _run(BatchGenerator(model, **kw), IDLE_ARRIVALS, 12)
    passes = _count_passes(monkeypatch)
    gen = FusedGenerator(model, fuse=fuse, **kw)
    assert gen.idle_read
    (uid,) = gen.insert([IDLE_ARRIVALS[0][0]], max_tokens=[12])
    _, responses = gen.next()
    assert [r.uid for r in responses] == [uid] and passes == ["prompt"]
    passes.clear()
    _, responses = gen.next()
    # lean_decode: a fused generator's decode passes are fused_hidden's
    decode = "one group" if fuse else "model"
    assert [r.uid for r in responses] == [uid] and passes == [decode, decode]

    passes.clear()
    gen = FusedGenerator(model, fuse=fuse, **kw)
    assert _run(gen, IDLE_ARRIVALS, 12) == reference
    if fuse:
        assert gen.fused_steps > 0  # the second prompt rode with the first row's passes
    piped = FusedGenerator(model, fuse=fuse, idle_read=False, **kw)
    assert _run(piped, IDLE_ARRIVALS, 12) == reference
    piped.insert([IDLE_ARRIVALS[0][0]], max_tokens=[12])
    passes.clear()
    piped.next()
    assert passes == ["prompt", decode]  # mlx-lm's pipeline: the next pass first


def test_a_row_removed_before_its_pass_is_built_leaves_the_rest_whole(
    tiny_model_dir: Path,
) -> None:
    """A request aborted right after an idle step gave its first token (its
    pass not yet built): its cache and tokens agree, and the next request
    gets mlx-lm's greedy tokens."""
    model = load(str(tiny_model_dir))[0]
    kw = GENERATOR_SIZES
    first, second = IDLE_ARRIVALS[0][0], IDLE_ARRIVALS[1][0]
    reference = _run(BatchGenerator(model, **kw), {0: [second]}, 12)
    gen = FusedGenerator(model, **kw)
    (uid,) = gen.insert([first], max_tokens=[12])
    _, responses = gen.next()
    assert [r.uid for r in responses] == [uid]
    ((cache, tokens),) = gen.remove([uid], return_prompt_caches=True).values()
    assert tokens == first and all(c.offset == len(first) for c in cache)
    assert _run(gen, {0: [second]}, 12) == reference


def test_the_step_that_builds_a_deferred_pass_says_so(tiny_model_dir: Path) -> None:
    """The step after an idle read builds two passes: the runner marks it
    `settled`, and the engine keeps it out of its decode-step estimate."""
    runner = Runner(tiny_model_dir, max_batch=4, prefill_batch=4, prefill_chunk=64)
    core = EngineCore(
        runner,
        SchedulerConfig(max_batch=4, prefill_batch=4, prefill_chunk=64, chunk_buckets=(16,)),
        memory_budget_bytes=8 << 30,
    )
    try:
        uid = runner.insert(IDLE_ARRIVALS[0][0], 8, GREEDY)
        first = runner.step()
        assert [e.uid for e in first.tokens] == [uid] and not first.settled
        assert [runner.step().settled for _ in range(3)] == [True, False, False]
        while runner.active:
            runner.step()

        core.add(Add("a", IDLE_ARRIVALS[1][0], 6, GREEDY))
        settled, estimates = [], []
        while core.has_work():
            core.step()
            settled.append(runner.generator.settling)
            estimates.append(core.scheduler.decode_step_s.value)
        assert settled.count(True) == 1
        i = settled.index(True)
        # the settled step (the first with a decode row) taught it nothing;
        # the steady one after it did
        assert estimates[i] is None and estimates[i + 1] is None
        assert estimates[i + 2] is not None
    finally:
        runner.close()


def test_engine_with_the_fused_step_matches_the_engine_without(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EngineCore over a fused runner: paced prompts beside streams, an abort
    inside a prefill, and the same greedy tokens as the two-pass runner (with
    `join_read` too: the long prompt's first token in its last chunk's step)."""

    def drive(fused: bool, rows: bool = False, join_read: bool = False) -> dict[str, list[int]]:
        runner = Runner(
            tiny_model_dir,
            max_batch=16,
            prefill_batch=8,
            prefill_chunk=64,
            fused=fused,
            decode_rows=rows,
            join_read=join_read,
        )
        assert runner.fused == fused and runner.generator.decode_rows == rows
        core = EngineCore(
            runner,
            SchedulerConfig(max_batch=16, prefill_batch=8, prefill_chunk=64, chunk_buckets=(16,)),
            memory_budget_bytes=8 << 30,
        )
        outputs: dict[str, list[Any]] = {}

        def step() -> None:
            out = core.step()
            for o in out.outputs if out is not None else []:
                outputs.setdefault(o.request_id, []).append(o)

        for i in range(4):
            core.add(Add(f"s{i}", [(7 * i + j) % 500 + 3 for j in range(9)], 40, GREEDY))
        while runner.decoding < 4:
            step()
        core.add(Add("long", [(11 * j) % 500 + 3 for j in range(150)], 8, GREEDY))
        core.add(Add("gone", [(13 * j) % 500 + 3 for j in range(150)], 8, GREEDY))
        for _ in range(3):
            step()
        core.abort(["gone", "s1"])  # one inside its prefill, one decoding
        for rid, outs in run_to_completion(core).items():
            outputs.setdefault(rid, []).extend(outs)
        assert outputs["gone"][-1].finish_reason == "abort"
        assert len(tokens_of(outputs["long"])) == 8
        assert (runner.generator.fused_steps > 0) == fused
        runner.close()
        return {rid: tokens_of(outs) for rid, outs in outputs.items() if rid != "gone"}

    two_passes = drive(fused=False)
    assert drive(fused=True) == two_passes
    assert drive(fused=True, rows=True) == two_passes
    joined: list[int] = []
    plain = fused_module._Batch.join_reported

    def join_reported(self: Any, batch: Any) -> None:
        joined.extend(batch.uids)
        plain(self, batch)

    monkeypatch.setattr(fused_module._Batch, "join_reported", join_reported)
    assert drive(fused=True, join_read=True) == two_passes
    assert joined  # the long prompt's row joined with its first token out


@pytest.mark.parametrize(("pad_rows", "rows"), [(False, False), (True, False), (True, True)])
def test_a_step_that_admits_a_prompt_waits_for_the_device_no_more_than_a_paced_one(
    tiny_model_dir: Path, pad_rows: bool, rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 32: on the GPU the paced step that admits a prompt beside streams
    took 7-10 ms more than the next one of its size. A host read-back during
    admission would do that (a wait for the step queued before it, as a
    row's leaving once did: worker/batch_padding.py). Every step here, the
    admitting one included, makes the same device waits: the previous step's
    tokens read once, the next step queued."""
    batch_padding.install()
    model = load(str(tiny_model_dir))[0]
    gen = FusedGenerator(model, fuse=True, pad_rows=pad_rows, rows=rows, **dict(GENERATOR_SIZES))
    calls: list[str] = []

    def noting(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kw: Any) -> Any:
            calls.append(name)
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        noting(mx.array, name)
    for name in ("eval", "synchronize"):
        noting(mx, name)
    for prompt in ARRIVALS[0]:
        gen.insert([prompt], max_tokens=[40])
    for _ in range(4):
        gen.next()  # both prompts decode
    waits: list[list[str]] = []
    gen.insert([LONG_ARRIVALS[2][0][:64]], max_tokens=[2])
    for _ in range(3):  # the admitting step, then two paced ones (16-token chunks)
        calls.clear()
        gen.next()
        waits.append(sorted(calls))
    admitting, *paced = waits
    assert gen.fused_steps >= 3
    assert paced[0] == paced[1]
    assert admitting == paced[0] == ["eval", "tolist"]


def _batches_caches(gen: Any) -> list[list[Any]]:
    return [
        b.prompt_cache
        for b in (gen._prompt_batch, gen._generation_batch)
        if b.prompt_cache and all(type(c) is BatchKVCache for c in b.prompt_cache)
    ]


@pytest.mark.parametrize(("fuse", "pad_rows"), [(False, False), (True, False), (True, True)])
def test_the_hosts_padding_follows_the_devices_through_every_step(
    tiny_model_dir: Path, fuse: bool, pad_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """worker/batch_padding.py keeps each layer's padding on the host beside
    mlx-lm's array. Through streams, prompts of several chunks that join and
    leave, rows that leave from the middle and a long paced prompt, after every
    step both batches' host lists equal the device arrays, layer by layer."""
    batch_padding.install()
    monkeypatch.setattr(batch_padding, "host_padding", False)
    model = load(str(tiny_model_dir))[0]
    arrivals = {**ARRIVALS, 30: LONG_ARRIVALS[2], 31: [[5, 6, 7]]}
    gen = FusedGenerator(model, fuse=fuse, pad_rows=pad_rows, **dict(GENERATOR_SIZES))
    checked = 0
    real_next = gen.next

    def next_checking() -> Any:
        nonlocal checked
        out = real_next()
        for caches in _batches_caches(gen):
            assert batch_padding.host_paddings(caches) == batch_padding._paddings(caches)
            checked += 1
        return out

    gen.next = next_checking  # type: ignore[method-assign]
    _run(gen, arrivals, 9)
    assert checked > 40


def _counted_read_backs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every read-back of the padding from now on (batch_padding._paddings),
    as the number of layers it read."""
    reads: list[int] = []
    real = batch_padding._paddings

    def counted(caches: list[Any]) -> list[list[int]]:
        reads.append(len(caches))
        return real(caches)

    monkeypatch.setattr(batch_padding, "_paddings", counted)
    return reads


@pytest.mark.parametrize("pad_rows", [False, True])
def test_with_host_padding_rows_leave_without_a_read_back_and_the_tokens_are_mlx_lms(
    tiny_model_dir: Path, pad_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_padding.install()
    model = load(str(tiny_model_dir))[0]
    reference = _run(BatchGenerator(model, **GENERATOR_SIZES), ARRIVALS, 9)
    reads = _counted_read_backs(monkeypatch)
    for on in (False, True):
        monkeypatch.setattr(batch_padding, "host_padding", on)
        reads.clear()
        gen = FusedGenerator(model, fuse=True, pad_rows=pad_rows, **dict(GENERATOR_SIZES))
        assert _run(gen, ARRIVALS, 9) == reference
        assert (len(reads) > 0) == (not on)  # off: rows leaving read the device back


def test_with_host_padding_the_engine_gives_the_same_tokens_through_the_prefix_cache(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EngineCore as the worker builds it, with the prefix cache: a first wave
    of prompts of several lengths, then turns that extend them (prefix-cache
    hits: caches merged into a batch, rows extracted for the cache as they
    end). With `host_padding` no row's padding is read from the device, and
    every request's tokens are those of the engine without it. It is on in a
    worker configured with the defaults (session 33's GPU run)."""
    from protocol.worker_config import WorkerConfig
    from worker.core import core_for, runner_for

    reads = _counted_read_backs(monkeypatch)
    monkeypatch.setattr(batch_padding, "host_padding", False)  # restored after: runner_for sets it
    prompts = [[(7 * j + k) % 400 + 3 for j in range(n)] for k, n in enumerate((40, 90, 17, 65))]
    results = {}
    for on in (False, True, None):  # None: the default
        chosen = {} if on is None else {"host_padding": on}
        cfg = WorkerConfig(socket="", model=str(tiny_model_dir), fused_step="on", **chosen)
        core = core_for(cfg, runner_for(cfg, tiny_model_dir))
        reads.clear()
        out: dict[str, list[int]] = {}
        for turn in range(2):
            for k, p in enumerate(prompts):
                history = p if turn == 0 else p + out[f"0/{k}"] + [9, 10, 11]
                core.add(Add(f"{turn}/{k}", history, 6 + k, GREEDY))
            out.update({rid: tokens_of(o) for rid, o in run_to_completion(core).items()})
        assert core.prefix_cache.stats.hits >= len(prompts)  # the second turns reused the first
        results[on] = (out, len(reads))
        core.runner.close()
    assert results[True][0] == results[False][0] == results[None][0]
    assert results[False][1] > 0 and results[True][1] == 0 and results[None][1] == 0
