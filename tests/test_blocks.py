"""worker/blocks.py: each layer's cache-free parts compiled.

The compiled pass must compute what the uncompiled one does (logits and
every cache), over joined and unjoined projections and several row groups,
and a layer's functions must trace once per shape, not once per step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache

from worker import blocks
from worker.fused import fused_hidden, logits_of
from worker.joined import join_projections

ARGS = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=300,
    tie_word_embeddings=False,
)


def _model(joined: bool) -> Any:
    mx.random.seed(5)
    model = llama.Model(llama.ModelArgs(**ARGS))
    mx.eval(model.parameters())
    if joined:
        assert join_projections(model) == 4  # q/k/v and gate/up in both layers
    return model


def _tokens(rows: int, length: int, salt: int) -> mx.array:
    return mx.array([[(11 * r + 7 * j + salt) % 300 for j in range(length)] for r in range(rows)])


def _primed(model: Any) -> tuple[list[BatchKVCache], list[BatchKVCache]]:
    """Decode rows' caches holding a left-padded history, and an empty
    prompt batch's."""
    decode = [BatchKVCache([0, 2, 1]) for _ in model.model.layers]
    model(_tokens(3, 5, 1), cache=decode)
    return decode, [BatchKVCache([0]) for _ in model.model.layers]


def _states(caches: list[BatchKVCache]) -> list[mx.array]:
    return [a for c in caches for a in c.keys_and_values()]


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("pad_rows", [False, True])
def test_the_compiled_pass_computes_what_the_uncompiled_one_does(
    joined: bool, pad_rows: bool
) -> None:
    model = _model(joined)
    (ours, our_chunk), (theirs, their_chunk) = _primed(model), _primed(model)
    for step in range(3):  # a fused pass, then decode passes over the grown caches
        groups = [(_tokens(3, 1, step), ours)]
        their_groups = [(_tokens(3, 1, step), theirs)]
        if step == 0:
            groups.append((_tokens(1, 9, 4), our_chunk))
            their_groups.append((_tokens(1, 9, 4), their_chunk))
        got = fused_hidden(model, groups, pad_rows)
        with blocks.uncompiled():
            want = fused_hidden(model, their_groups, pad_rows)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            assert mx.allclose(logits_of(model, a), logits_of(model, b), atol=1e-5).item()
    for a, b in zip(_states(ours + our_chunk), _states(theirs + their_chunk), strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()
    assert getattr(model.model.layers[0], "mlxd_blocks", None) is not None


def test_a_layer_traces_once_per_shape_not_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled function's Python body runs only while MLX traces it: the
    same decode rows step after step (the rows' offsets and the caches'
    positions moving) must replay the trace, and a new row count traces again."""
    model = _model(joined=True)
    traced: list[int] = []
    finish = blocks._finish

    def counted(layer: Any, x: mx.array, attended: mx.array) -> mx.array:
        traced.append(int(x.shape[0]))
        return finish(layer, x, attended)

    monkeypatch.setattr(blocks, "_finish", counted)
    decode, _ = _primed(model)
    for step in range(6):
        (hidden,) = fused_hidden(model, [(_tokens(3, 1, step), decode)])
        mx.eval(hidden)
    layers = len(model.model.layers)
    assert traced == [3] * layers  # each layer traced at 3 rows, once
    decode[0].filter([0, 2])
    for c in decode[1:]:
        c.filter([0, 2])
    (hidden,) = fused_hidden(model, [(_tokens(2, 1, 9), decode)])
    mx.eval(hidden)
    assert traced == [3] * layers + [2] * layers


def test_uncompiled_passes_make_no_compiled_functions() -> None:
    model = _model(joined=True)
    decode, _ = _primed(model)
    with blocks.uncompiled():
        (hidden,) = fused_hidden(model, [(_tokens(3, 1, 0), decode)])
    mx.eval(hidden)
    assert all(getattr(layer, "mlxd_blocks", None) is None for layer in model.model.layers)
