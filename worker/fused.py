"""One forward pass for the decode rows and a prefill chunk (issue #12, item 3).

mlx-lm's BatchGenerator runs a step as two passes over the model: one for the
decoding rows (one token each), then one for the prompt chunk of the rows
still prefilling. On a GPU each pass has a fixed cost close to a whole decode
step (kernel launches for every layer), so a prompt arriving beside streams
stalls them for both. This module owns the alternative:

- `fused_hidden`: the model's layers over several row groups at once. Norms,
  the q/k/v/o projections and the MLP run once over all groups' new tokens
  (one matmul per weight, read once); attention runs per group over that
  group's own cache (the decode rows over the generation batch's
  BatchKVCache, the chunk over the prompt batch's). Written for the llama
  family's block (llama, mistral, qwen2, qwen3: pre-norm attention and MLP,
  optional q/k norms), which `supports_fusion` checks; anything else keeps
  mlx-lm's two passes.
- `FusedGenerator`: a BatchGenerator whose step runs the decode rows and the
  prompt chunk in that one pass when both exist. Admission, the prompt
  bookkeeping and the decode step's sampling are mlx-lm's own (the decode
  batch's `next()` runs unchanged; only its model call is answered by the
  fused pass). One difference in order (`early_join`, also without fusion):
  prompts that finished prefilling join the decode rows before this step's
  decode pass instead of after it. mlx-lm starts a joined row with its own
  pass over the row's last prompt token, and its decode step reports the
  tokens of the pass before; joined after the decode, a row's first token
  came out one whole step later than the pass that computed it. Joined
  before, it comes out in the same step: every request's TTFT is one step
  shorter, with the same passes per step and the same tokens.
- `chunk_start` (on where `supports_fusion`; needs `early_join`): the
  pass over a prompt's last token is not a pass of its own. mlx-lm keeps the
  last token out of the prompt chunks and runs it alone when the row joins
  the decode batch (a whole forward pass for one token per row, on a GPU
  about a decode step's cost), then samples the first token from it. Here a
  prompt's last chunk takes its last token too, the last layer's attention
  and MLP and the vocabulary projection run at that position only
  (`prompt_hidden_at`; a pass whose output no one read skipped them), and the
  row's decode batch is built with those logits answering its first step
  (`_Answer`), so mlx-lm's own sampling, logits processors and bookkeeping
  run unchanged. One pass fewer for every step in which prompts finish, and
  (two passes) the first token comes out in the step of the prompt's last
  chunk, one step sooner than `early_join` alone. The logits are the same
  computation at another query length; on this CPU the greedy tokens equal
  mlx-lm's (tests/test_fused.py). With `fuse`, the finished rows join after
  the pass, and the chunk's last layer runs at every position in any case:
  `fused_hidden` runs each layer's matmuls once over all groups' tokens, so
  lazy evaluation cannot drop the chunk's share (cutting that layer down to
  the decode rows and the prompts' ends would save a layer of chunk work in
  every fused step; not done while fusion is off by default).

- `lean_decode` (wherever steps are fused): a decode-only step's pass, and
  every decode pass, is `fused_hidden`'s over the decode rows alone instead
  of the model's own forward. The same layers and arithmetic with fewer
  primitives: `fused_hidden` keeps the activations two-dimensional (tokens x
  width), where the model's modules run on (rows, length, width) and MLX
  wraps every projection's matmul in a flatten and an unflatten. On the
  H200 a step is bound by the primitives MLX evaluates, not by their
  arithmetic (session 22: `thin32`, llama8b's 32 layers at a width whose
  matmuls cost next to nothing, decoded 16 rows in 8.2 ms against llama8b's
  9.2, 2,138 primitives a step, two thirds of them views;
  `bench.pacing_probe --count-ops`, `bench.launch_probe`).
  Measured step by step inside one engine (session 23, `bench.variant_probe`):
  0.97 of the model's own decode pass on llama8b, thin32 and qwen0.5b.
- joined projections (wherever steps are fused; worker/joined.py):
  `fused_hidden` reads q, k and v from one matmul and the MLP's gate and up
  from another, four projections a layer instead of seven, the weights
  shared as views with the model's own modules. With `lean_decode`, a
  llama8b decode step 0.865 of the model's own (14.0 -> 12.1 ms), a fused
  one 0.871 (session 23, `bench.variant_probe`). Joined, q and k are also
  rotated as one array (`qk_v`, session 24): one RoPE and one copy a layer
  and row group fewer.

- fewer graph nodes a layer (wherever `fused_hidden` runs; worker/blocks.py,
  session 39): a plain Linear's weight transposed once instead of at every
  call, each residual added by the GEMM that feeds it (AddMM), and the
  decode rows' heads made by reshapes alone. A CUDA step is bound by the
  host's work, which scales with the pass's nodes (session 38); on an
  H100 a 0.5B decode step took 0.926 of session 38's (the first two).
- the caches written in place (`buffer_decode`, session 40): each row
  group's offsets are made once a pass and go to every layer's cache
  (`next_offsets`) where each layer's cache added its own (an Add and its
  Broadcast a layer); where the ragged decode attention kernel serves, the
  decode rows' attention reads the whole buffers, the mask saying how
  many slots count, where mlx-lm's update hands back slices of them, and
  the kernel writes its output as the output projection takes it (five
  nodes a layer fewer on the decode rows: two slices, the Add and its
  Broadcast, a reshape); a padded prompt chunk (`_padded`) reads the
  buffers itself, so no slice of them is built for it.
- fewer nodes for a prompt chunk (session 44): the pass's row groups are
  cut out of the joined projections by one Split each (a slice a group
  before), and where `prompt_attention.enabled` (WorkerConfig
  `prompt_attention`, off by default until a GPU run times it) a chunk's
  attention is worker/prompt_attention.py's five nodes in place of MLX's
  fallback's thirteen or so, its mask's bias made once a pass (`_bias`).

- `idle_read` (on by default; WorkerConfig.idle_read): mlx-lm's decode step
  builds and queues the pass over the tokens it is about to report before it
  reads them back, so the device never waits for the host between steps.
  With nothing else decoding there is nothing to keep fed, and that order
  only delays the first tokens by the host's time to build a pass (on a GPU,
  where a small pass is bound by its kernel launches, about a decode step).
  So a step that finishes prompts while the decode batch is empty reads
  their first tokens right after the prompt pass (`_Batch.report_now`), and
  the pass over them is built at the next step or when rows join
  (`_Batch.settle`): the same passes and tokens, one pass build sooner for
  every idle request's first token, and the next step builds two passes.
- `join_read` (on by default since session 42's H100 A/B; WorkerConfig.join_read):
  the same read for prompts that finish in a fused step. With fusion, a
  prompt's row joins the decode batch after the pass, and the next step's
  `next()` reports its first token after building that step's pass: on the
  GPU (session 41, the step traces) that next step took 8-11 ms on the 0.5B
  shape and 32 ms on the 8B one (the join's copy), and the TTFT under
  mixed pressure waited for all of it. With `join_read` the fused step reads
  the finished prompts' first tokens before it returns (`_Batch.report_now`,
  waiting for the fused pass) and the rows join with their pass still to
  build: it is the decode batch's next pass, as before, whose report leaves
  them out once (`_Batch.join_reported`). The same passes and tokens; the
  wait for the fused pass moves into that step (1.5-2 ms on the H100, where
  the first token came 7.6 ms (0.5B) and 21.7 ms (8B) sooner).

- `pad_rows` (CUDA; worker/backend.py): every pass this module runs has its
  token rows padded with zero rows to one of a few dozen sizes (`pass_rows`).
  MLX's CUDA backend asks cuBLASLt for a matmul algorithm at every shape it
  has not met, about 3 ms per projection shape on the H200 (session 17,
  `bench.shape_probe`: the four projections of the 8B shape 11-15 ms the first
  time at a new row count, 0.3-0.6 ms the second), and a pass's row count,
  decode rows plus a chunk, is new in nearly every step that carries a prompt:
  its first chunk, its last (the remainder), every new number of decode rows.
  The pacing probe's second arrival of a prompt, which met only shapes the
  first had met, took 25-28 ms in the steps where the first took 41-51 ms.
  Padded, steady operation meets only sizes the warm-up ran
  (`Runner.warm_shapes`). The zero rows stay zero through every layer (no
  attention, no cache) and are dropped at the end; in a bandwidth-bound pass
  they cost next to nothing. Prefill-only passes then go through
  `fused_hidden` too, whose last layer runs at every position. A prompt
  chunk's attention runs at warm lengths too (`_padded`): its keys to the end
  of the cache's buffer (a multiple of 256), its queries to `pass_rows`;
  attention at a new (query, key) length cost 4-8 ms the first time on the
  8B shape, and padded, the same few lengths recur from prompt to prompt
  (the warm-up runs those of single-row chunks of every padded length up to
  `prefill_chunk`, over up to 4,096 keys).

- `decode_rows` (off by default; WorkerConfig.decode_rows): the decode
  batch's KV in worker/decode_rows.py's layout instead of mlx-lm's
  BatchKVCache. `_started` hands the finished prompts' buffers over as they
  are, `_Batch` joins, filters and extracts rows through that module (all
  layers at once; mlx-lm's per-layer methods are not for it), and
  `_reserve_prompt_kv` asks the decode batch for room for the prompts
  still prefilling.

Threading: engine thread only, like worker/runner.py.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    PromptProcessingBatch,
    StopSequences,
)
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache

from worker import decode_attention, decode_rows, joined, prompt_attention
from worker.batch_padding import host_paddings, release, reserve, written
from worker.blocks import finished, merged_heads, projected, rotated
from worker.joined import dense, join_projections, mlp, prepare_dense, qkv

# Model families whose decoder block is the plain pre-norm attention + MLP that
# `fused_hidden` reproduces (their attention differs only by optional q/k norms).
FUSABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# The caches written in place, each group's offsets one array a pass
# (`next_offsets`), the decode rows' read whole by the attention kernel
# (session 40). Off: session 39's pass, for bench.variant_probe's A/B.
buffer_decode = True
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads")


def supports_fusion(model: Any) -> bool:
    """Whether `fused_hidden` computes exactly what this model's own forward does."""
    if getattr(model, "model_type", None) not in FUSABLE_MODEL_TYPES:
        return False
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return False
    if getattr(inner, "pipeline_size", 1) != 1 or getattr(inner, "swa_idx", None) is not None:
        return False  # pipeline ranks and sliding-window layers have their own masks
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in _ATTENTION_PARTS):
            return False
        if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm")):
            return False
    return True


_ROW_STEPS = ((256, 32), (1024, 64), (2048, 128), (4096, 256))


def pass_rows(n: int) -> int:
    """The rows a padded pass of `n` token rows runs (module docstring,
    `pad_rows`): `n` rounded up to a multiple of 32 up to 256 rows, of 64 up
    to 1,024, of 128 up to 2,048, of 256 up to 4,096 and of 512 beyond. About
    thirty sizes cover a pass of a 2,048-token chunk beside a decode batch;
    from 256 rows on, the padding is under a quarter of the rows."""
    step = next((s for limit, s in _ROW_STEPS if n <= limit), 512)
    return -(-n // step) * step


def padded_sizes(limit: int) -> list[int]:
    """Every `pass_rows` size up to the one `limit` rows pad to."""
    sizes, n = [], 1
    while True:
        sizes.append(pass_rows(n))
        if sizes[-1] >= limit:
            return sizes
        n = sizes[-1] + 1


def _width_and_dtype(model: Any) -> tuple[int, mx.Dtype]:
    """The hidden width and the activations' dtype, from the final norm's
    weight (an embedding's weight is packed when the model is quantized)."""
    weight = model.model.norm.weight
    return int(weight.shape[-1]), weight.dtype


def projections(model: Any, rows: int, logits: bool) -> list[mx.array]:
    """The first layer's projections and MLP over `rows` zero rows, and with
    `logits` the vocabulary projection: every matmul shape a pass of that
    many rows meets (Runner.warm_shapes), the model's own (mlx-lm's prompt
    passes) and worker/blocks.py's (the residuals added by the GEMMs)."""
    width, dtype = _width_and_dtype(model)
    layer = model.model.layers[0]
    attn = layer.self_attn
    x = mx.zeros((rows, width), dtype)
    q, k, v = qkv(attn, x)
    out = [q, k, v, attn.o_proj(q), mlp(layer.mlp, x), finished(layer, x, q)]
    return [*out, logits_of(model, x)] if logits else out


def _attend(
    layer: Any,
    q: mx.array,
    k: mx.array | None,
    v: mx.array,
    rows: int,
    length: int,
    mask: Any,
    cache: Any,
    pad: bool = False,
    masks: dict[Any, mx.array] | None = None,
    after: mx.array | None = None,
) -> mx.array:
    """One group's attention, as the model's Attention.__call__ does it after
    the projections; with `pad`, a prompt chunk's at warm lengths (`_padded`,
    sharing the padded masks in `masks` across the pass's layers). `k` None:
    `q` holds q and k side by side (worker/joined.py, `qk_v`), rotated as one
    (worker/blocks.py, `rotated`). `after`: the group's offsets after
    this pass, every layer's (`next_offsets`): the cache is written in place
    (the decode rows' attention reads its whole buffers where the kernel
    takes them)."""
    attn = layer.self_attn
    if k is None:
        q, k, v = rotated(layer, q, v, rows, length, cache.offset)
    else:
        q = q.reshape(rows, length, attn.n_heads, -1)
        k = k.reshape(rows, length, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=cache.offset)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=cache.offset)
        v = v.reshape(rows, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    padded = pad and length > 1 and isinstance(mask, mx.array) and type(cache) is BatchKVCache
    if after is not None and type(cache) is BatchKVCache:
        k, v = written(cache, k, v, after)  # the whole buffers
        if length == 1 and decode_attention.takes_buffers():
            # laid out as the output projection takes it: no reshape after
            return decode_attention.attention(q, k, v, cache, attn.scale, mask, flat=True)
        if not padded:  # `_padded` reads the buffers itself
            k, v = k[:, :, : cache._idx], v[:, :, : cache._idx]
    else:
        k, v = cache.update_and_fetch(k, v)
    if padded:
        q, k, v, mask = _padded(q, mask, cache, masks)
    if length > 1 and isinstance(mask, mx.array) and _grouped(cache):
        out = prompt_attention.attention(q, k, v, attn.scale, _bias(mask, q, k, masks))
    else:
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    if out.shape[2] != length:
        out = out[:, :, :length]
    return merged_heads(out, rows, length)


def _grouped(cache: Any) -> bool:
    """A prompt chunk's attention over this cache runs as
    worker/prompt_attention.py computes it (fewer graph nodes than MLX's
    fallback)."""
    return prompt_attention.enabled and not joined.plain_pass and type(cache) is BatchKVCache


def _bias(mask: mx.array, q: mx.array, k: mx.array, masks: dict[Any, mx.array] | None) -> mx.array:
    """The chunk's mask as worker/prompt_attention.py adds it, made once a
    pass (every layer's mask is the same: kept in `masks` beside
    `_padded`'s, which are keyed by the key count alone)."""
    key = ("bias", int(mask.shape[-1]))
    made = masks.get(key) if masks is not None else None
    if made is None:
        made = prompt_attention.bias(mask, q.shape[1], k.shape[1], q.dtype)
        if masks is not None:
            masks[key] = made
    return made


def _padded(
    q: mx.array, mask: mx.array, cache: BatchKVCache, masks: dict[Any, mx.array] | None = None
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A prompt chunk's attention at warm lengths (module docstring, `pad_rows`):
    the keys and values up to the end of the cache's last filled 256-slot
    step (worker/batch_padding.py grows buffers on that grid, at times
    further ahead, `reserve`; one a filter shifted off the grid is padded
    back onto it here, a copy), their slots past the cache's end masked
    out, and the queries padded with zero rows to `pass_rows` of the chunk
    (rows no one reads; they attend every key, so none is a row of -inf).
    A chunk's attention matmuls are then one of a few shapes that recur from
    prompt to prompt instead of a new (chunk, cache length) pair at nearly every step,
    each of which cost 4-8 ms the first time on the 8B shape. The buffer's
    slots past the end hold zeros or earlier keys, finite either way, and
    their weight is exactly zero.

    `masks` (the padded mask by key length, one dict per group and pass):
    every layer's cache holds the same rows and lengths, so the padded mask
    is the same at every layer; padded once, it is two device copies a pass
    instead of two a layer (on a GPU a small pass is bound by its kernel
    launches, so a fused step's cost grows with its kernels)."""
    assert cache.keys is not None and cache.values is not None
    k, v = cache.keys, cache.values
    buffer, length = k.shape[2], q.shape[2]
    keys = -(-cache._idx // cache.step) * cache.step
    if keys > buffer:
        grid = [(0, 0), (0, 0), (0, keys - buffer), (0, 0)]
        k, v = mx.pad(k, grid), mx.pad(v, grid)
    elif keys < buffer:  # reserved ahead (worker/batch_padding.py, `reserve`)
        k, v = k[..., :keys, :], v[..., :keys, :]
    queries = pass_rows(length) - length
    if queries > 0:
        q = mx.pad(q, [(0, 0), (0, 0), (0, queries), (0, 0)])
    padded = masks.get(keys) if masks is not None else None
    if padded is None:
        padded = _padded_mask(mask, keys, queries)
        if masks is not None:
            masks[keys] = padded
    return q, k, v, padded


def _padded_mask(mask: mx.array, keys: int, queries: int) -> mx.array:
    """`mask` widened to `keys` (the new slots masked out) and given `queries`
    more rows that attend every key (`_padded`)."""
    extra = keys - mask.shape[-1]
    if extra > 0:
        mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, extra)])
    if queries > 0:
        rows = [(0, 0)] * (mask.ndim - 2) + [(0, queries), (0, 0)]
        mask = mx.pad(mask, rows, constant_values=True)
    return mask


def chunk_attention(model: Any, chunk: int, keys: int) -> mx.array:
    """The first layer's attention for one prompt row's `chunk` tokens (zeros)
    ending at `keys` cached tokens, padded as a pass with `pad_rows` runs it:
    the warm-up's way to meet those shapes (Runner.warm_shapes). `keys`: a
    multiple of BatchKVCache.step, the buffer's length."""
    width, dtype = _width_and_dtype(model)
    layer = model.model.layers[0]
    attn = layer.self_attn
    x = mx.zeros((chunk, width), dtype)
    q, k, v = projected(layer, x)
    dim = v.shape[-1] // attn.n_kv_heads
    cache = BatchKVCache([0])
    buffer = mx.zeros((1, attn.n_kv_heads, keys, dim), x.dtype)
    cache.state = (buffer, buffer, mx.array([keys - chunk]), mx.array([0]), keys - chunk)
    mask = create_attention_mask(x[None], cache)  # (rows, length, width), as a pass builds it
    return _attend(layer, q, k, v, 1, chunk, mask, cache, pad=True)


def next_offsets(tokens: mx.array, caches: list[Any]) -> mx.array | None:
    """A row group's offsets after this pass, one array for every layer's
    BatchKVCache (worker/batch_padding.py, `written`: the caches are written
    in place); None where each layer's cache updates itself (other caches,
    session 39's pass)."""
    if not buffer_decode or joined.plain_pass or type(caches[0]) is not BatchKVCache:
        return None
    return caches[0].offset + tokens.shape[1]


def fused_hidden(
    model: Any, groups: list[tuple[mx.array, list[Any]]], pad_rows: bool = False
) -> list[mx.array]:
    """The final hidden states of each (tokens (rows, length), per-layer caches) group.

    Every group's tokens are laid end to end as one sequence for everything but
    attention, so each weight is read once for all of them. With `pad_rows`
    that sequence is padded with zero rows to `pass_rows` of its length
    (module docstring, `pad_rows`); attention never sees the padding.
    """
    inner = model.model
    embedded = [inner.embed_tokens(tokens) for tokens, _ in groups]
    masks = [
        create_attention_mask(h, caches[0]) for h, (_, caches) in zip(embedded, groups, strict=True)
    ]
    shapes = [(int(h.shape[0]), int(h.shape[1])) for h in embedded]
    width = embedded[0].shape[-1]
    total = sum(rows * length for rows, length in shapes)
    pad = pass_rows(total) - total if pad_rows else 0
    filler = [mx.zeros((pad, width), embedded[0].dtype)] if pad else []
    flat = [h.reshape(-1, width) for h in embedded] + filler
    x = mx.concatenate(flat, axis=0) if len(flat) > 1 else flat[0]
    # Built once a pass, not once a layer: the chunk's padded mask (`_padded`)
    # and the attention output's zero rows (every layer's are alike).
    padded_masks: list[dict[Any, mx.array]] = [{} for _ in groups]
    afters = [next_offsets(tokens, caches) for tokens, caches in groups]
    # Where each group's rows end in the pass, the padding after the last cut off.
    ends = list(itertools.accumulate(rows * length for rows, length in shapes))
    cuts = ends if pad else ends[:-1]
    attention_filler: mx.array | None = None
    for i, layer in enumerate(inner.layers):
        q, k, v = projected(layer, x)
        parts = [
            _attend(layer, gq, gk, gv, rows, length, mask, caches[i], pad_rows, memo, after)
            for (rows, length), mask, (_, caches), memo, after, gq, gk, gv in zip(
                shapes,
                masks,
                groups,
                padded_masks,
                afters,
                _by_group(q, cuts, len(groups)),
                _by_group(k, cuts, len(groups)),
                _by_group(v, cuts, len(groups)),
                strict=True,
            )
        ]
        if pad:
            if attention_filler is None:
                attention_filler = mx.zeros((pad, parts[0].shape[-1]), parts[0].dtype)
            parts.append(attention_filler)
        x = finished(layer, x, mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0])
    out, start = [], 0
    for rows, length in shapes:
        # Normed per group: a prompt chunk's hidden states are never read (only
        # its caches are), so lazy evaluation skips its final norm entirely.
        out.append(inner.norm(x[start : start + rows * length]).reshape(rows, length, width))
        start += rows * length
    return out


def _by_group(a: mx.array | None, cuts: list[int], groups: int) -> list[Any]:
    """`a`'s rows for each of `groups`, cut at `cuts` by one Split node (a
    slice a group made one each), the padding after the last dropped; `a`
    itself for a lone unpadded group (no cuts)."""
    if a is None:
        return [None] * groups
    if not cuts:
        return [a]
    return list(mx.split(a, cuts, axis=0))[:groups]


def prompt_hidden_at(
    model: Any, tokens: mx.array, caches: list[Any], ends: list[tuple[int, int]]
) -> mx.array:
    """A prompt pass over `tokens` (rows, length) into `caches`, and the final
    hidden state (len(ends), 1, width) at each (row, position) of `ends`.

    The model's own layers run over every position except the last layer,
    whose keys and values still go into its cache for every position but whose
    attention and MLP run at the `ends` only: a prompt pass that no one reads
    the output of skips that layer's attention and MLP by lazy evaluation, and
    reading one position must not bring them back for all of them (on the
    2-layer test model it did: half the prompt pass again)."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    mask = create_attention_mask(h, caches[0], return_array=True)
    for layer, cache in zip(inner.layers[:-1], caches[:-1], strict=True):
        h = layer(h, mask, cache)
    layer, cache = inner.layers[-1], caches[-1]
    attn = layer.self_attn
    rows, cols = _end_index(ends)
    n, (batch, length, _) = len(ends), h.shape
    normed = layer.input_layernorm(h)
    q = attn.q_proj(normed[rows, cols]).reshape(n, 1, attn.n_heads, -1)
    k = attn.k_proj(normed).reshape(batch, length, attn.n_kv_heads, -1)
    v = attn.v_proj(normed).reshape(batch, length, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    offset = cache.offset  # per row; each query sits `col` positions further on
    q = attn.rope(q, offset=(offset[rows] if isinstance(offset, mx.array) else offset) + cols)
    k = attn.rope(k, offset=offset)
    keys, values = cache.update_and_fetch(k, v)
    # Each end's row of the causal (and padding) mask the other layers used.
    end_mask = mx.take_along_axis(mask[rows], cols.reshape(n, 1, 1, 1), axis=2)
    out = scaled_dot_product_attention(
        q, keys[rows], values[rows], cache=cache, scale=attn.scale, mask=end_mask
    )
    x = h[rows, cols][:, None, :] + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(n, 1, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)


def logits_of(model: Any, hidden: mx.array) -> mx.array:
    if getattr(model.args, "tie_word_embeddings", False):
        return model.model.embed_tokens.as_linear(hidden)
    return cast(mx.array, dense(model.lm_head)(hidden))


class _OnePass:
    """Answers the decode batch's one model call with `fused_hidden`'s pass: with
    a chunk, the fused pass, which also runs the chunk into the prompt batch's
    caches; without, the decode rows alone (`lean_decode`)."""

    def __init__(
        self,
        model: Any,
        chunk: mx.array | None = None,
        chunk_cache: list[Any] | None = None,
        ends: list[tuple[int, int]] | None = None,
        pad_rows: bool = False,
    ) -> None:
        self.model, self.chunk, self.chunk_cache = model, chunk, chunk_cache
        self.ends = ends or []
        self.pad_rows = pad_rows
        self.start_logits: mx.array | None = None

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        if self.chunk is None or self.chunk_cache is None:
            (decode,) = fused_hidden(self.model, [(inputs, cache)])
            return logits_of(self.model, decode)
        groups = [(inputs, cache), (self.chunk, self.chunk_cache)]
        decode, chunk = fused_hidden(self.model, groups, self.pad_rows)
        if self.ends:
            self.start_logits = _logits_at(self.model, chunk, self.ends)
        return logits_of(self.model, decode)


class _Answer:
    """Stands in for the model in a GenerationBatch's first step: its logits
    were computed by the prompt's own pass."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.logits


class _Reported(StopSequences.Matcher):
    """A row's stop matcher for the one report of a token it already matched
    (`_Batch.next` after `join_reported`): the token moves it no further."""

    def __init__(self, inner: StopSequences.Matcher) -> None:
        self.inner = inner  # no automaton of its own: advance() is all it does

    def advance(self, token: int) -> bool:
        return False


class _Batch(GenerationBatch):
    """mlx-lm's GenerationBatch, able to report the tokens it holds for its
    next pass without building that pass first (`report_now`; module
    docstring, `idle_read`). The pass over those tokens is then built when the
    batch next steps or grows (`settle`), so every token is still computed,
    reported and fed back once, in mlx-lm's order. Its caches may be in
    worker/decode_rows.py's layout (`decode_rows`): then rows join, leave
    and are extracted through that module, and a row that leaves from the
    middle takes the last row into its place in every list and array."""

    _report_only = False
    _reported = False  # the pending tokens went out; their pass is not built yet
    # rows that joined with their pending token already reported (`join_reported`)
    _early: frozenset[int] = frozenset()

    def report_now(self) -> list[Any]:
        """A `next()` that reads the pending tokens instead of queueing the pass
        over them first: mlx-lm's finish checks, the same responses."""
        self._report_only = True
        try:
            return self.next()
        finally:
            self._report_only = False

    def join_reported(self, batch: _Batch) -> None:
        """Take `batch`'s rows after its `report_now` (module docstring,
        `join_read`): the pass over their reported tokens is this batch's next
        pass, and its report leaves those tokens out, their counts and stop
        matchers already moved. Rows that finished there are gone from it."""
        if not batch.uids:
            return
        early = frozenset(batch.uids)
        self.extend(batch)  # its pending pass is ours now: our next one
        self._early = self._early | early

    def next(self) -> list[Any]:
        early = self._early
        if not early or self._report_only:
            return super().next()
        self._early = frozenset()
        for i, uid in enumerate(self.uids):
            if uid in early:
                self._num_tokens[i] -= 1  # counted again below
                self._matchers[i] = _Reported(self._matchers[i])
        try:
            responses = super().next()
        finally:
            self._matchers = [m.inner if isinstance(m, _Reported) else m for m in self._matchers]
        return [r for r in responses if r.uid not in early]

    @property
    def pending_pass(self) -> bool:
        return self._reported and bool(self.uids)

    def settle(self) -> None:
        """Build and queue the pass over tokens `report_now` gave out (a no-op
        otherwise). Its read-back of those tokens is already done."""
        if self.pending_pass:
            self._reported = False
            super()._step()

    def _step(self) -> tuple[list[int], list[mx.array]]:
        if self._report_only:
            mx.eval(self._next_tokens, self._next_logprobs)
            self._reported = True
            return cast(list[int], self._next_tokens.tolist()), self._next_logprobs
        self.settle()
        return super()._step()

    def extend(self, batch: Any) -> None:
        self.settle()  # rows that join bring tokens not yet reported
        mine, theirs = self.prompt_cache, batch.prompt_cache
        if not (mine and theirs) or not (decode_rows.is_rows(mine) or decode_rows.is_rows(theirs)):
            super().extend(batch)
            return
        self.prompt_cache = _as_rows(mine)
        decode_rows.join(self.prompt_cache, _as_rows(theirs))
        with _caches_aside(batch):
            super().extend(batch)

    def filter(self, keep: list[int]) -> None:
        caches = self.prompt_cache
        if keep and decode_rows.is_rows(caches):
            # The rows past the new count fill the holes: only they move.
            keep = decode_rows.hole_order(keep, len(self.uids))
            decode_rows.leave(caches, keep)
            with _caches_aside(self):
                super().filter(keep)
        else:
            super().filter(keep)
        self._reported = self._reported and bool(keep)

    def extract_cache(self, idx: int) -> list[Any]:
        if decode_rows.is_rows(self.prompt_cache):
            return list(decode_rows.extract(self.prompt_cache, idx))
        return cast(list[Any], super().extract_cache(idx))


@contextmanager
def _caches_aside(batch: Any) -> Iterator[None]:
    """mlx-lm's own bookkeeping on `batch` (its extend, its filter) with its
    caches, already joined or filtered in the rows layout, out of its reach."""
    caches, batch.prompt_cache = batch.prompt_cache, []
    try:
        yield
    finally:
        batch.prompt_cache = caches


def _as_rows(caches: list[Any]) -> list[Any]:
    """`caches` in worker/decode_rows.py's layout (BatchKVCache layers taken as
    they are)."""
    if decode_rows.is_rows(caches):
        return caches
    kept = host_paddings(caches)
    rows = decode_rows.as_rows(caches, kept[0] if kept else None)
    if rows is None:
        raise TypeError("only BatchKVCache layers with KV in them take the rows layout")
    return rows


def _end_index(ends: list[tuple[int, int]]) -> tuple[mx.array, mx.array]:
    """The rows and the positions of `ends`, as index arrays."""
    return mx.array([r for r, _ in ends]), mx.array([c for _, c in ends])


def _logits_at(model: Any, hidden: mx.array, ends: list[tuple[int, int]]) -> mx.array:
    """(rows, 1, vocab) logits at each (row, position) of `hidden`: the
    vocabulary projection runs for those positions only."""
    rows, cols = _end_index(ends)
    return logits_of(model, hidden[rows, cols][:, None, :])


class FusedGenerator(BatchGenerator):
    """A BatchGenerator whose steps carry the decode rows and the prompt chunk in
    one forward pass when both exist, and whose prompts start generating from
    their own pass (module docstring)."""

    def __init__(
        self,
        model: Any,
        *args: Any,
        fuse: bool = True,
        early_join: bool = True,
        chunk_start: bool = True,
        idle_read: bool = True,
        join_read: bool = False,
        pad_rows: bool = False,
        join: bool = True,
        rows: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, *args, **kwargs)
        self._generation_batch = _Batch.empty(self.model, self.sampler)
        self.fuse = fuse and supports_fusion(model)
        # The decode batch's KV in worker/decode_rows.py's layout: rows join
        # and leave without the others being copied.
        self.decode_rows = rows and supports_fusion(model)
        # fused_hidden's projections as four matmuls a layer (worker/joined.py)
        self.joined = join_projections(model) if self.fuse and join else 0
        if self.fuse:
            prepare_dense(model)  # worker/blocks.py's transposed weights
        self.pad_rows = pad_rows and supports_fusion(model)
        self.early_join = early_join
        self.chunk_start = chunk_start and early_join and supports_fusion(model)
        self.idle_read = idle_read
        self.join_read = join_read
        # `lean_decode` where steps are fused (bench.variant_probe turns it
        # off step by step to measure it)
        self.lean = True
        self.fused_steps = 0
        # Each step waits for its own prompt pass instead of queueing it (the
        # warm-up calibration's setting, worker/calibrate.py): queued, a pass's
        # device time is paid by the step after it, and a step's duration is no
        # longer what its pass cost.
        self.timed_passes = False

    def drop_all(self) -> None:
        """Forget every sequence, queued, prefilling or decoding, without reading
        any of their state (after a step that raised: it may hold arrays whose
        evaluation failed). Uids keep counting up, so none is reused."""
        self._prompt_batch = PromptProcessingBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._generation_batch = _Batch.empty(self.model, self.sampler)
        self._unprocessed_sequences.clear()
        self._currently_processing = []

    @property
    def settling(self) -> bool:
        """Whether the next step also builds the pass over tokens an idle step
        already reported (`idle_read`): a step of two passes."""
        gen = self._generation_batch
        return isinstance(gen, _Batch) and gen.pending_pass

    @contextmanager
    def _lean(self) -> Iterator[None]:
        """The decode batch's own passes as `fused_hidden` runs them where steps
        are fused (module docstring, `lean_decode`)."""
        gen = self._generation_batch
        if not (self.fuse and self.lean):
            yield
            return
        gen.model = _OnePass(self.model)
        try:
            yield
        finally:
            gen.model = self.model

    def _next(self) -> tuple[list[Any], list[Any]]:
        gen = self._generation_batch
        decode_only = len(gen) >= self.completion_batch_size or not (
            len(self._prompt_batch) or self._unprocessed_sequences
        )
        with self._lean():
            if isinstance(gen, _Batch):
                gen.settle()  # before anything swaps its model (`_fused`) or extends it
            if decode_only:
                return super()._next()  # nothing to admit or prefill: mlx-lm's decode step
        fuse = self.fuse and len(gen) > 0
        if self.chunk_start:
            return self._next_chunk_start(fuse)
        if not (fuse or self.early_join):
            return super()._next()
        self._admit()
        prompt_responses = self._start_generating()
        chunks, _ = self._cut_chunks(prompt_responses, with_last=False)
        if fuse:
            decoded = self._fused(chunks, [])[0] if chunks else self._decode()
            return prompt_responses, decoded
        # Two passes, in the early-join order: the decode pass (the rows that
        # joined included, so their first token is this step's), then the chunk.
        responses = self._decode()
        if chunks:
            self._counters.prompt_tokens += sum(len(c) for c in chunks)
            tic = time.perf_counter()
            self._prompt_batch.prompt(chunks)
            self._counters.prompt_time += time.perf_counter() - tic
        return prompt_responses, responses

    def _next_chunk_start(self, fuse: bool) -> tuple[list[Any], list[Any]]:
        """A step whose prompt pass also gives the first token's logits of the
        prompts it finishes (module docstring, `chunk_start`)."""
        gen = self._generation_batch
        idle = not len(gen)
        self._admit()
        prompt_responses: list[Any] = []
        chunks, ends = self._cut_chunks(prompt_responses, with_last=True)
        if fuse:
            # The finished prompts join after the pass; their first token is
            # the input of the next step's pass, which reports it (or, with
            # `join_read`, this step reads it and that report leaves it out).
            responses, logits = self._fused(chunks, ends)
            if logits is not None:
                started = self._started(ends, chunks, logits)
                if self.join_read and isinstance(gen, _Batch):
                    responses = [*responses, *started.report_now()]
                    gen.join_reported(started)
                else:
                    gen.extend(started)
            return prompt_responses, responses
        tic = time.perf_counter()
        logits = self._prefill(chunks, ends)
        if logits is not None and idle and self.idle_read:
            # Nothing else decodes, so there is no pipeline to keep fed: the
            # first tokens are read as soon as the prompt pass gives them.
            started = self._started(ends, chunks, logits)
            self._generation_batch = started
            self._queue([c.state for c in self._prompt_batch.prompt_cache])
            responses = self._decode(started.report_now)
            self._counters.prompt_time += time.perf_counter() - tic
            return prompt_responses, responses
        if logits is not None:
            gen.extend(self._started(ends, chunks, logits))
        # The decode pass carries the joined rows' first tokens; reading them
        # back waits for the prompt pass, which it depends on. The rows still
        # prefilling are queued, not waited for (mlx-lm's prompt() evaluates
        # them): a wait here would hold the host until this step's decode pass
        # and chunk ran, so the next step's graph would be built while the
        # device idles. Queued, the step is pipelined as a decode step is.
        responses = self._decode()
        self._queue([c.state for c in self._prompt_batch.prompt_cache])
        self._counters.prompt_time += time.perf_counter() - tic
        return prompt_responses, responses

    def _queue(self, *arrays: Any) -> None:
        """Start computing `arrays`; wait for them only with `timed_passes`."""
        (mx.eval if self.timed_passes else mx.async_eval)(*arrays)

    def _admit(self) -> None:
        """mlx-lm's admission from the queue into the prompt batch."""
        n = min(
            self.prefill_batch_size - len(self._prompt_batch),
            self.completion_batch_size - len(self._generation_batch),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            self._prompt_batch.extend(self._make_batch(n))

    def _start_generating(self) -> list[Any]:
        """mlx-lm's hand-over of the rows with only their last prompt token left
        to the decode batch (before this step's pass, so they decode in it)."""
        done = [
            i
            for i, seq in enumerate(self._currently_processing)
            if len(seq[0]) == 1 and len(seq[0][0]) == 1
        ]
        responses: list[Any] = []
        if done:
            last = [self._currently_processing[i][0][0] for i in done]
            progress = [(self._currently_processing[i][2],) * 2 for i in done]
            self._currently_processing = [
                seq for i, seq in enumerate(self._currently_processing) if i not in done
            ]
            started = self._prompt_batch.split(done).generate(last)
            for uid, p in zip(started.uids, progress, strict=True):
                responses.append(PromptProcessingBatch.Response(uid, p, True, True))
            self._generation_batch.extend(started)
        return responses

    def _cut_chunks(
        self, responses: list[Any], with_last: bool
    ) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """This step's piece of every prompt still prefilling, as mlx-lm cuts it;
        `with_last`, a piece with room for it also takes the prompt's last
        token, which mlx-lm keeps for a pass of its own. Returns the pieces and,
        for each prompt that ends in this step, (row, index of its last token)."""
        self._reserve_prompt_kv()
        chunks: list[list[int]] = []
        ends: list[tuple[int, int]] = []
        for i, seq in enumerate(self._currently_processing):
            response = PromptProcessingBatch.Response(
                self._prompt_batch.uids[i], (0, 0), False, False
            )
            segments = seq[0]
            n = min(len(segments[0]), self.prefill_step_size)
            piece = segments[0][:n]
            segments[0] = segments[0][n:]
            if len(segments[0]) == 0:
                segments.pop(0)
                response.end_of_segment = True
            only_last = len(segments) == 1 and len(segments[0]) == 1
            if with_last and only_last and len(piece) < self.prefill_step_size:
                piece = piece + segments.pop(0)
            if with_last and not segments:
                response.end_of_prompt = response.end_of_segment = True
                ends.append((i, len(piece) - 1))
            chunks.append(piece)
            seq[1] += len(piece)
            response.progress = (seq[1], seq[2])
            responses.append(response)
        return chunks, ends

    def _reserve_prompt_kv(self) -> None:
        """The prompt batch's caches, when they next grow, grow to where its
        longest prompt ends (worker/batch_padding.py, `reserve`). Its rows
        are aligned at their ends and every step's chunks are padded to the
        longest, so the batch fills exactly its longest remainder more slots."""
        caches = self._prompt_batch.prompt_cache
        rest = max((seq[2] - seq[1] for seq in self._currently_processing), default=0)
        if rest > 0 and caches and type(caches[0]) is BatchKVCache:
            reserve(caches, caches[0]._idx + rest)
            rows = self._generation_batch.prompt_cache
            if decode_rows.is_rows(rows):
                # room in the decode batch for these rows, grown a few layers a
                # step before they join (worker/decode_rows.py)
                joining = len(self._generation_batch) + len(self._currently_processing)
                rows[0].layout.reserve(joining, caches[0]._idx + rest + 1)

    def _prefill(self, chunks: list[list[int]], ends: list[tuple[int, int]]) -> mx.array | None:
        """The prompt pass (lazy), and the logits at `ends` (None without any)."""
        batch = self._prompt_batch
        tokens, padded = _pad_chunks(batch, chunks, ends)
        logits = None
        if self.pad_rows:
            # The pass as fused_hidden runs it, padded; the last layer runs at
            # every position (prompt_hidden_at's cut is mlx-lm's layers).
            (hidden,) = fused_hidden(self.model, [(tokens, batch.prompt_cache)], True)
            if ends:
                logits = _logits_at(self.model, hidden, ends)
        elif ends:
            hidden = prompt_hidden_at(self.model, tokens, batch.prompt_cache, ends)
            logits = logits_of(self.model, hidden)
        else:
            self.model.model(tokens, cache=batch.prompt_cache)  # only the caches are read
        _finalize_padding(batch, padded)
        self._counters.prompt_tokens += sum(len(c) for c in chunks)
        return logits

    def _started(
        self, ends: list[tuple[int, int]], chunks: list[list[int]], logits: mx.array
    ) -> _Batch:
        """The prompts that ended in this step, as a decode batch whose first
        step samples from `logits` (what GenerationBatch's own first pass, over
        each row's last prompt token, would compute) instead of running a pass."""
        rows = [r for r, _ in ends]
        last = mx.array([chunks[r][-1] for r in rows])
        ended = set(rows)
        self._currently_processing = [
            seq for i, seq in enumerate(self._currently_processing) if i not in ended
        ]
        if len(rows) == len(self._prompt_batch):
            # All of them: take the batch whole. split() would copy every
            # row's cache and then gather it back (a wave that finishes
            # together, a lone prompt).
            batch = self._prompt_batch
            self._prompt_batch = PromptProcessingBatch.empty(
                self.model, self.sampler, prefill_step_size=self.prefill_step_size
            )
        else:
            batch = self._prompt_batch.split(rows)
        started = _Batch(
            _Answer(logits),  # type: ignore[arg-type]
            batch.uids,
            last,
            batch.prompt_cache,
            batch.tokens,
            batch.samplers,
            batch.fallback_sampler,
            batch.logits_processors,
            batch.stop_sequences,
            batch.max_tokens,
        )
        started.model = self.model
        release(started.prompt_cache)
        if self.decode_rows and decode_rows.takes(started.prompt_cache):
            started.prompt_cache = _as_rows(started.prompt_cache)
        return started

    def _fused(
        self, chunks: list[list[int]], ends: list[tuple[int, int]]
    ) -> tuple[list[Any], mx.array | None]:
        """The decode batch's step, whose one pass also prefills the chunks;
        the logits at `ends` come from that pass too."""
        gen = self._generation_batch
        tic = time.perf_counter()
        batch = self._prompt_batch
        tokens, padded = _pad_chunks(batch, chunks, ends)
        one = _OnePass(self.model, tokens, batch.prompt_cache, ends, self.pad_rows)
        gen.model = one
        try:
            responses = gen.next()
        finally:
            gen.model = self.model
        _finalize_padding(batch, padded)
        logits = one.start_logits
        # Queued, not waited for: see _next_chunk_start.
        self._queue([c.state for c in batch.prompt_cache], *([] if logits is None else [logits]))
        self._counters.prompt_tokens += sum(len(c) for c in chunks)
        self.fused_steps += 1
        self._counters.decode_time += time.perf_counter() - tic
        self._counters.generation_tokens += len(responses)
        self._counters.generation_steps += 1
        return responses, logits

    def _decode(self, step: Callable[[], list[Any]] | None = None) -> list[Any]:
        """The decode batch's own step (none while it is empty); `step` in
        place of its `next()`."""
        gen = self._generation_batch
        if not len(gen):
            return []
        tic = time.perf_counter()
        with self._lean():
            responses = (step or gen.next)()
        self._counters.decode_time += time.perf_counter() - tic
        self._counters.generation_tokens += len(responses)
        self._counters.generation_steps += 1
        return responses


def _finalize_padding(batch: Any, padded: bool) -> None:
    """Move a padded chunk's padding to the left, as mlx-lm's prompt() does."""
    if padded:
        for c in batch.prompt_cache:
            c.finalize()


def _pad_chunks(
    batch: Any, chunks: list[list[int]], ends: list[tuple[int, int]]
) -> tuple[mx.array, bool]:
    """The chunks as one (rows, length) array, right-padded as mlx-lm's
    PromptProcessingBatch.prompt pads them (the caches learn the padding).

    `batch.tokens` lists the tokens in each row's cache; a prompt ending here
    leaves its last token out, which its decode batch's first step adds."""
    ended = {r for r, _ in ends}
    for r, (seen, piece) in enumerate(zip(batch.tokens, chunks, strict=True)):
        seen += piece[:-1] if r in ended else piece
    lengths = [len(p) for p in chunks]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    if max(padding) == 0:
        return mx.array(chunks), False
    for c in batch.prompt_cache:
        c.prepare(lengths=lengths, right_padding=padding)
    return mx.array([p + [0] * (longest - len(p)) for p in chunks]), True
