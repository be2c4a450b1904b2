"""worker/prompt_attention.py: a prompt chunk's attention in fewer graph nodes.

It must compute what MLX's `scaled_dot_product_attention` computes (grouped
and plain heads, several rows with left padding, padded query rows that
attend every key), a fused pass with it must leave the logits and every
cache as the fallback's pass does, and the pass must hand MLX fewer nodes,
the mask's bias made once a pass, not once a layer.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache

from bench.pacing_probe import primitives_of
from tests.worker_helpers import SMALL_BLOCK
from worker import prompt_attention
from worker.fused import fused_hidden, logits_of

ARGS: dict[str, Any] = dict(model_type="llama", **SMALL_BLOCK)


def _mask(rows: int, queries: int, keys: int, padded_queries: int = 0) -> mx.array:
    """Causal over the last `queries` of `keys`, row r left-padded by 2r
    slots, and `padded_queries` more rows that attend every key."""
    q = mx.arange(queries)[:, None] + keys - queries
    k = mx.arange(keys)[None]
    left = mx.array([2 * r for r in range(rows)]).reshape(rows, 1, 1, 1)
    mask = (k <= q)[None, None] & (k >= left)
    if padded_queries:
        mask = mx.pad(mask, [(0, 0), (0, 0), (0, padded_queries), (0, 0)], constant_values=True)
    return mask


@pytest.mark.parametrize(
    "rows,heads,kv_heads,queries,keys,size",
    [(1, 14, 2, 37, 300, 64), (3, 4, 4, 5, 20, 16), (2, 32, 8, 64, 256, 128)],
)
@pytest.mark.parametrize("padded_queries", [0, 11])
def test_it_computes_what_mlxs_attention_does(
    rows: int, heads: int, kv_heads: int, queries: int, keys: int, size: int, padded_queries: int
) -> None:
    mx.random.seed(3)
    total = queries + padded_queries
    q = mx.random.normal((rows, heads, total, size))
    k, v = (mx.random.normal((rows, kv_heads, keys, size)) for _ in range(2))
    mask = _mask(rows, queries, keys, padded_queries)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=size**-0.5, mask=mask)
    bias = prompt_attention.bias(mask, heads, kv_heads, q.dtype)
    got = prompt_attention.attention(q, k, v, size**-0.5, bias)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_masked_key_gets_no_weight_in_bfloat16() -> None:
    """The bias is the dtype's lowest value: its weight is exactly zero, so a
    key the mask hides changes nothing however large its value."""
    mx.random.seed(4)
    q = mx.random.normal((1, 4, 6, 16)).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 10, 16)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 10, 16)).astype(mx.bfloat16)
    mask = _mask(1, 6, 8)  # two keys past the end: masked
    mask = mx.pad(mask, [(0, 0), (0, 0), (0, 0), (0, 2)])
    bias = prompt_attention.bias(mask, 4, 2, mx.bfloat16)
    loud = mx.concatenate([v[:, :, :8], mx.full((1, 2, 2, 16), 1e4, mx.bfloat16)], axis=2)
    a = prompt_attention.attention(q, k, v, 0.25, bias)
    b = prompt_attention.attention(q, k, loud, 0.25, bias)
    assert mx.array_equal(a, b).item()
    assert mx.isfinite(a).all().item()


def _model() -> Any:
    mx.random.seed(5)
    model = llama.Model(llama.ModelArgs(**ARGS))
    mx.eval(model.parameters())
    return model


def _tokens(rows: int, length: int, salt: int) -> mx.array:
    return mx.array([[(11 * r + 7 * j + salt) % 300 for j in range(length)] for r in range(rows)])


def _caches(model: Any) -> tuple[list[BatchKVCache], list[BatchKVCache]]:
    """Decode rows with a left-padded history, and a prompt batch of two rows
    (one left-padded) that already holds a first chunk."""
    decode = [BatchKVCache([0, 2, 1]) for _ in model.model.layers]
    model(_tokens(3, 5, 1), cache=decode)
    chunk = [BatchKVCache([0, 3]) for _ in model.model.layers]
    model(_tokens(2, 7, 2), cache=chunk)
    mx.eval([c.state for c in decode + chunk])
    return decode, chunk


def _fused_pass(model: Any, pad_rows: bool) -> tuple[list[mx.array], list[mx.array]]:
    decode, chunk = _caches(model)
    groups = [(_tokens(3, 1, 3), decode), (_tokens(2, 9, 4), chunk)]
    hidden = fused_hidden(model, groups, pad_rows)
    states = [a for c in decode + chunk for a in c.keys_and_values()]
    return [logits_of(model, h) for h in hidden], states


@pytest.mark.parametrize("pad_rows", [False, True])
def test_a_fused_pass_leaves_what_mlxs_attention_leaves(
    pad_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    monkeypatch.setattr(prompt_attention, "enabled", True)
    logits, states = _fused_pass(model, pad_rows)
    monkeypatch.setattr(prompt_attention, "enabled", False)
    want_logits, want_states = _fused_pass(model, pad_rows)
    for a, b in zip(logits + states, want_logits + want_states, strict=True):
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=1e-5).item()


@pytest.mark.parametrize("pad_rows", [False, True])
def test_a_fused_pass_hands_mlx_fewer_nodes_and_one_mask_a_pass(
    pad_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    layers = len(model.model.layers)

    def counted() -> dict[str, int]:
        return primitives_of(lambda: mx.eval(_fused_pass(model, pad_rows)))

    counted()  # the weights' transposed views made (worker/blocks.py), once
    monkeypatch.setattr(prompt_attention, "enabled", True)
    now = counted()
    monkeypatch.setattr(prompt_attention, "enabled", False)
    before = counted()
    # MLX's fallback: the scale's Multiply, the heads' Unflatten and k's, v's
    # and the mask's ExpandDims, a Select a layer; here one AddMM a layer,
    # and the mask's Select once a pass.
    assert sum(now.values()) <= sum(before.values()) - 6 * layers
    assert now.get("AddMM", 0) - before.get("AddMM", 0) == layers
    assert before.get("Select", 0) - now.get("Select", 0) == layers - 1
