"""worker/blocks.py and worker/joined.py's `dense`: a layer in fewer graph nodes.

The pass must compute what session 38's pass (`as_before`) does, logits and
every cache, over joined and unjoined projections and several row groups;
and it must have fewer nodes: no weight transposed in it, the residuals in
the GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache

from bench.pacing_probe import primitives_of
from tests.worker_helpers import SMALL_BLOCK
from worker import blocks, fused
from worker import decode_attention as da
from worker.fused import fused_hidden, logits_of
from worker.joined import dense, join_projections, prepare_dense

ARGS = dict(model_type="llama", **SMALL_BLOCK, tie_word_embeddings=False)


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
    mx.eval([c.state for c in decode])
    return decode, [BatchKVCache([0]) for _ in model.model.layers]


def _decode_pass(with_state: bool) -> tuple[Any, Callable[[], None]]:
    """The joined model and a build of its 3-row decode pass, evaluated (with
    the caches' new state, which the next step reads, if `with_state`)."""
    model = _model(joined=True)
    decode, _ = _primed(model)
    tokens = _tokens(3, 1, 0)

    def build() -> None:
        (hidden,) = fused_hidden(model, [(tokens, decode)])
        mx.eval(logits_of(model, hidden), [c.state for c in decode] if with_state else [])

    return model, build


def _groups(
    step: int, decode: list[BatchKVCache], chunk: list[BatchKVCache]
) -> list[tuple[mx.array, list[BatchKVCache]]]:
    """A step's row groups: the decode rows, and in the first step a chunk
    of a new prompt beside them (a fused pass)."""
    groups = [(_tokens(3, 1, step), decode)]
    if step == 0:
        groups.append((_tokens(1, 9, 4), chunk))
    return groups


def _states(caches: list[BatchKVCache]) -> list[mx.array]:
    return [a for c in caches for a in c.keys_and_values()]


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("pad_rows", [False, True])
def test_the_pass_computes_what_session_38s_pass_does(joined: bool, pad_rows: bool) -> None:
    model = _model(joined)
    (ours, our_chunk), (theirs, their_chunk) = _primed(model), _primed(model)
    for step in range(3):  # a fused pass, then decode passes over the grown caches
        got = fused_hidden(model, _groups(step, ours, our_chunk), pad_rows)
        with blocks.as_before():
            want = fused_hidden(model, _groups(step, theirs, their_chunk), pad_rows)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            assert mx.allclose(logits_of(model, a), logits_of(model, b), atol=1e-5).item()
    for a, b in zip(_states(ours + our_chunk), _states(theirs + their_chunk), strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()


def test_the_decode_pass_has_no_transpose_of_its_own_and_adds_its_residuals_in_the_gemms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # session 39's pass: the caches update themselves (session 40's writes:
    # the tests below)
    monkeypatch.setattr(fused, "buffer_decode", False)
    model, build = _decode_pass(with_state=False)
    build()  # the weights' transposed views made (one evaluation each, once)
    with blocks.as_before():
        before = primitives_of(build)
    now = primitives_of(build)
    layers = len(model.model.layers)
    # the weights' transposes gone (q/k/v, o, gate/up, down and the
    # vocabulary's), and with one token a row those of q and k, v and the
    # attention's output
    assert before["Transpose"] - now["Transpose"] == 7 * layers + 1
    assert now.get("AddMM", 0) == 2 * layers and "AddMM" not in before
    assert before["Add"] - now.get("Add", 0) == 2 * layers
    assert sum(now.values()) == sum(before.values()) - 9 * layers - 1


def test_a_weight_is_transposed_once_as_a_view_and_quantized_ones_are_left_alone() -> None:
    linear = nn.Linear(8, 4, bias=False)
    made = dense(linear)
    assert made is dense(linear)  # kept on the module
    assert made.weight_t.shape == (8, 4)
    x = mx.ones((2, 8))
    assert mx.allclose(made(x), linear(x)).item()
    quantized = nn.QuantizedLinear(64, 32)
    assert dense(quantized) is quantized
    with blocks.as_before():
        assert dense(linear) is linear


def test_the_fused_generator_makes_every_view_before_its_first_step(tiny_model_dir: Any) -> None:
    """No pass stops to evaluate a view (on a GPU that waits for the queue)."""
    from mlx_lm.utils import load

    from worker.fused import FusedGenerator

    model, _ = load(str(tiny_model_dir))
    FusedGenerator(model, max_tokens=4)
    layers = model.model.layers
    for layer in layers:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert "mlxd_dense" in module.__dict__
    assert prepare_dense(model) == 0  # nothing left to make


@pytest.fixture
def kernel_in_place(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The ragged decode kernel in place as on CUDA (worker/decode_attention.py),
    its arithmetic MLX's over the keys the mask counts: the kernel itself runs
    on CUDA only (tests/test_decode_attention.py checks it there). Counts the
    calls whose keys came longer than the mask."""
    whole: list[int] = []

    def kernel(
        q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, flat: bool = False
    ) -> mx.array:
        n = mask.shape[-1]
        assert k.shape[2] >= n and v.shape == k.shape
        whole.append(k.shape[2] - n)
        out = da.MLX_LM_ATTENTION(q, k[:, :, :n], v[:, :, :n], cache=None, scale=scale, mask=mask)
        return out.reshape(out.shape[0], -1) if flat else out

    monkeypatch.setattr(da, "ragged_attention", kernel)
    monkeypatch.setattr(da, "HEAD_DIMS", (16, 64, 128))  # the small block's heads are 16 wide
    da.install()
    try:
        yield whole
    finally:
        da.uninstall()


@pytest.mark.parametrize("pad_rows", [False, True])
def test_decode_rows_written_in_place_compute_what_sliced_caches_do(
    kernel_in_place: list[int], pad_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over several steps, one fused with a chunk and one growing every buffer
    (8-slot steps here): the same logits and caches as session 39's pass, one
    offset array shared by every layer, and attention handed whole buffers."""
    monkeypatch.setattr(BatchKVCache, "step", 8)
    model = _model(joined=True)
    (ours, our_chunk), (theirs, their_chunk) = _primed(model), _primed(model)
    assert da.takes_buffers()
    for step in range(6):  # the history is 5 tokens: slot 8 needs a new buffer
        got = fused_hidden(model, _groups(step, ours, our_chunk), pad_rows)
        monkeypatch.setattr(fused, "buffer_decode", False)
        want = fused_hidden(model, _groups(step, theirs, their_chunk), pad_rows)
        monkeypatch.setattr(fused, "buffer_decode", True)
        for a, b in zip(got, want, strict=True):
            assert mx.allclose(logits_of(model, a), logits_of(model, b), atol=1e-5).item()
        assert len({id(c.offset) for c in ours}) == 1  # the step that grows them too
        assert len({id(c.offset) for c in theirs}) == len(theirs)
    for a, b in zip(_states(ours + our_chunk), _states(theirs + their_chunk), strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()
    for a, b in zip(ours, theirs, strict=True):
        assert a.offset.tolist() == b.offset.tolist() and a._idx == b._idx
    assert any(kernel_in_place)  # keys handed over longer than the mask


def test_decode_rows_written_in_place_take_five_nodes_a_layer_fewer(
    kernel_in_place: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No slice of the keys or values, one offset Add (and its 1's Broadcast)
    a pass, not one a layer, and no reshape of the attention's output:
    counted with the caches' new state, which the next step reads."""

    def stand_in(
        q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, flat: bool = False
    ) -> mx.array:
        # the same nodes for k and v whole or sliced, and for either layout
        shape = (q.shape[0], q.shape[1] * q.shape[3]) if flat else q.shape
        return mx.broadcast_to(q.sum() * k.sum() * v.sum(), shape)

    monkeypatch.setattr(da, "ragged_attention", stand_in)
    model, build = _decode_pass(with_state=True)
    build()
    now = primitives_of(build)
    monkeypatch.setattr(fused, "buffer_decode", False)
    before = primitives_of(build)
    layers = len(model.model.layers)
    assert before["Slice"] - now.get("Slice", 0) == 2 * layers
    assert before["Add"] - now["Add"] == layers - 1
    assert before["Broadcast"] - now["Broadcast"] == layers - 1  # the Add's 1, broadcast
    assert before["Reshape"] - now["Reshape"] == layers  # the kernel's output laid out flat
    assert sum(before.values()) - sum(now.values()) == 5 * layers - 2


@pytest.mark.parametrize("pad_rows", [False, True])
def test_every_groups_offsets_are_made_once_a_pass(
    pad_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the decode kernel too (mlx-lm's attention reads the slices):
    the decode rows' and a prompt chunk's caches each get one offset array
    for all layers, one Add (and its Broadcast) a group and pass where each
    layer made its own, and the pass computes what session 39's does."""
    assert not da.takes_buffers()
    model = _model(joined=True)
    (ours, our_chunk), (theirs, their_chunk) = _primed(model), _primed(model)

    def build(decode: list[BatchKVCache], chunk: list[BatchKVCache], salt: int) -> list[mx.array]:
        groups = [(_tokens(3, 1, salt), decode), (_tokens(1, 9, 4 + salt), chunk)]
        out = [logits_of(model, h) for h in fused_hidden(model, groups, pad_rows)]
        mx.eval(out, [c.state for c in decode + chunk])
        return out

    got = build(ours, our_chunk, 0)
    monkeypatch.setattr(fused, "buffer_decode", False)
    want = build(theirs, their_chunk, 0)
    for a, b in zip(got, want, strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()
    before = primitives_of(lambda: build(theirs, their_chunk, 1))
    monkeypatch.setattr(fused, "buffer_decode", True)
    now = primitives_of(lambda: build(ours, our_chunk, 1))
    for caches in (ours, our_chunk):
        assert len({id(c.offset) for c in caches}) == 1
    layers = len(model.model.layers)
    assert before["Add"] - now["Add"] == 2 * (layers - 1)  # two groups
    assert before["Broadcast"] - now["Broadcast"] == 2 * (layers - 1)
    for a, b in zip(_states(ours + our_chunk), _states(theirs + their_chunk), strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()
