"""worker/joined.py: q/k/v and gate/up as one matmul each, weights shared as views.

Joining must change neither what the model computes (its own forward and
`fused_hidden`) nor the memory it holds, and must refuse what it cannot join.
"""

from __future__ import annotations

from contextlib import nullcontext as _nothing
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from tests.test_fused import _caches, _model, _tokens
from worker.fused import FusedGenerator, fused_hidden
from worker.joined import (
    JOINED_GATE_UP,
    JOINED_QKV,
    join,
    join_projections,
    qk_v,
    qkv,
    separate_rope,
    suspended,
)


def _params(model: Any) -> dict[str, mx.array]:
    return {k: mx.array(v) for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_joining_changes_no_output(kind: str) -> None:
    plain, joined = _model(kind), _model(kind)
    assert join_projections(joined) == 2 * len(joined.model.layers)
    tokens = _tokens(2, 9, 5)
    mx.eval(tokens)
    # the model's own forward (its modules now hold views) and fused_hidden's
    ours = joined(tokens, cache=_caches(joined, [0, 0]))
    theirs = plain(tokens, cache=_caches(plain, [0, 0]))
    assert mx.allclose(ours, theirs, atol=1e-5).item()
    (a,) = fused_hidden(joined, [(tokens, _caches(joined, [0, 0]))])
    (b,) = fused_hidden(plain, [(tokens, _caches(plain, [0, 0]))])
    assert mx.allclose(a, b, atol=1e-5).item()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_q_and_k_rotated_as_one_give_what_two_rotations_give(kind: str) -> None:
    """Decode rows beside a chunk over cached history, fused_hidden with q and
    k rotated together (`qk_v`) and apart: the same hidden states and caches."""
    model = _model(kind)
    join_projections(model)
    x = mx.zeros((3, int(model.model.norm.weight.shape[0])))
    attn = model.model.layers[0].self_attn
    together = qk_v(attn, x)
    assert together is not None
    q, k, _ = qkv(attn, x)
    assert together[0].shape[-1] == q.shape[-1] + k.shape[-1]
    history, decode, chunk = _tokens(2, 7, 1), _tokens(2, 1, 2), _tokens(1, 5, 3)
    outs, caches = [], []
    for apart in (False, True):
        dec, pro = _caches(model, [0, 3]), _caches(model, [0])
        model(history, cache=dec)
        model(history[:1, :4], cache=pro)
        with separate_rope() if apart else _nothing():
            outs.append(fused_hidden(model, [(decode, dec), (chunk, pro)]))
        caches.append(dec + pro)
    for a, b in zip(outs[0], outs[1], strict=True):
        assert mx.array_equal(a, b).item()
    for a, b in zip(*caches, strict=True):
        (ka, va), (kb, vb) = a.state[:2], b.state[:2]
        assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()


def test_q_and_k_are_rotated_apart_where_they_cannot_be_together() -> None:
    x = mx.zeros((2, 64))
    qwen3 = _model("qwen3")  # q and k norms sit between projection and rotation
    join_projections(qwen3)
    assert qk_v(qwen3.model.layers[0].self_attn, x) is None
    llama_model = _model("llama")
    assert qk_v(llama_model.model.layers[0].self_attn, x) is None  # not joined
    join_projections(llama_model)
    attn = llama_model.model.layers[0].self_attn
    with separate_rope():
        assert qk_v(attn, x) is None
    with suspended():
        assert qk_v(attn, x) is None


def test_joined_modules_are_not_parameters_and_share_the_weights() -> None:
    model = _model("llama")
    before = _params(model)
    mx.eval(before)
    join_projections(model)
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys()  # nothing counted twice
    for name, value in after.items():
        assert mx.array_equal(value, before[name]).item(), name
    attn = model.model.layers[0].self_attn
    assert getattr(attn, JOINED_QKV).ends == (64, 96, 128)
    assert getattr(model.model.layers[0].mlp, JOINED_GATE_UP).ends == (96, 192)
    assert join_projections(model) == 2 * len(model.model.layers)  # idempotent


def test_joining_does_not_grow_memory() -> None:
    # big enough that a copy of the joined weights would stand out
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=512,
        num_hidden_layers=4,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=64,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    mx.clear_cache()
    start = mx.get_active_memory()
    join_projections(model)
    mx.clear_cache()
    joined_bytes = sum(
        getattr(layer.self_attn, JOINED_QKV).module["weight"].nbytes
        + getattr(layer.mlp, JOINED_GATE_UP).module["weight"].nbytes
        for layer in model.model.layers
    )
    assert joined_bytes > 20_000_000
    assert mx.get_active_memory() - start < joined_bytes // 20


def test_quantized_projections_join() -> None:
    model = _model("llama")
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    x = mx.random.normal((3, 64), key=mx.random.key(1))
    attn = model.model.layers[0].self_attn
    expected = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    mx.eval(expected)
    assert join_projections(model) == 2 * len(model.model.layers)
    for ours, theirs in zip(qkv(attn, x), expected, strict=True):
        assert mx.allclose(ours, theirs, atol=1e-4).item()


def test_unlike_projections_are_not_joined() -> None:
    a, b = nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
    assert join([a, b]) is None  # one has a bias, the other not
    assert join([nn.Linear(8, 4), nn.Linear(6, 4)]) is None  # other input widths
    q = nn.QuantizedLinear(64, 32, group_size=32, bits=4)
    assert join([q, nn.QuantizedLinear(64, 32, group_size=64, bits=4)]) is None


def test_an_mlp_that_is_not_swiglu_keeps_its_own_forward() -> None:
    model = _model("llama")
    mlp = model.model.layers[0].mlp
    gelu = type(
        "GeluMLP",
        (type(mlp),),
        {"__call__": lambda s, x: s.down_proj(nn.gelu(s.gate_proj(x)) * s.up_proj(x))},
    )
    mlp.__class__ = gelu
    join_projections(model)
    assert getattr(mlp, JOINED_GATE_UP, None) is None
    assert getattr(model.model.layers[1].mlp, JOINED_GATE_UP, None) is not None


def test_a_fused_generator_joins_only_where_it_fuses() -> None:
    assert FusedGenerator(_model("llama"), fuse=True).joined == 4
    assert FusedGenerator(_model("llama"), fuse=False).joined == 0
    assert FusedGenerator(_model("llama"), fuse=True, join=False).joined == 0
