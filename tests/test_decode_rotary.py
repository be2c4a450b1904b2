"""worker/decode_rotary.py: which ropes the decode rows' rotary kernel takes,
how the pass calls it, and (on a CUDA machine only) that it rotates as MLX
does."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE

from tests.worker_helpers import SMALL_BLOCK
from worker import blocks
from worker import decode_rotary as dr
from worker.decode_attention import available
from worker.fused import fused_hidden, logits_of
from worker.joined import join_projections

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)


def _attn(rope: Any, heads: int = 4, kv_heads: int = 2) -> Any:
    return type("Attention", (), {"rope": rope, "n_heads": heads, "n_kv_heads": kv_heads})()


def test_the_kernel_is_put_in_place_only_where_the_setting_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`decode_rotary` is off by default (session 42: no faster on the 8B
    shape, 4% slower on the 0.5B one): the runner's choice asks for the kernel
    only with it, and never leaves an earlier runner's kernel on."""
    import worker.decode_attention as da
    from protocol.worker_config import DEFAULTS
    from worker.runner import _use_decode_kernel

    asked: list[object] = []
    monkeypatch.setattr(da, "available", lambda: True)
    monkeypatch.setattr(da, "model_case", lambda model: None)
    monkeypatch.setattr(da, "works", lambda *case: True)
    monkeypatch.setattr(da, "install", lambda: 0)
    monkeypatch.setattr(da, "uninstall", lambda: None)
    monkeypatch.setattr(dr, "enable", lambda model: asked.append(model) or True)
    assert DEFAULTS.decode_rotary is False
    monkeypatch.setattr(dr, "_enabled", True)  # an earlier runner's
    assert _use_decode_kernel(True, "model", DEFAULTS.decode_rotary)
    assert asked == [] and not dr.enabled()
    assert _use_decode_kernel(True, "model", True)
    assert asked == ["model"]


def test_the_ropes_it_reads_and_the_ones_it_leaves() -> None:
    plain = dr.rope_case(nn.RoPE(64, traditional=True, base=500000.0, scale=0.5), 64)
    assert plain is not None and plain[0] is True and plain[1] is None
    assert plain[2].tolist() == pytest.approx([0.5, 18.931568569324174])  # log2(500000)
    scaled = dr.rope_case(Llama3RoPE(64, base=500000.0, scaling_config=LLAMA3), 64)
    assert scaled is not None and scaled[1] is not None and scaled[1].shape == (32,)
    assert dr.rope_case(nn.RoPE(32), 64) is None  # a part of the head rotated
    assert dr.rope_case(YarnRoPE(64), 64) is None  # its own scaling of the output


def test_nothing_is_taken_until_enabled_and_not_while_suspended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attn = _attn(nn.RoPE(16))
    qk = mx.zeros((3, 6 * 16), mx.bfloat16)
    assert not dr.enabled() and not dr.takes(attn, qk)
    monkeypatch.setattr(dr, "_enabled", True)
    monkeypatch.setitem(dr._cases, id(attn.rope), dr.rope_case(attn.rope, 16))
    assert dr.takes(attn, qk)
    monkeypatch.setattr(dr, "suspended", True)
    assert not dr.takes(attn, qk)


def test_a_kernel_that_cannot_run_here_is_left_off(caplog: pytest.LogCaptureFixture) -> None:
    model = llama.Model(llama.ModelArgs(model_type="llama", **SMALL_BLOCK))
    if available():
        pytest.skip("the kernel runs here")
    with caplog.at_level(logging.WARNING):
        assert not dr.enable(model)
    assert not dr.enabled() and "failed its check" in caplog.text


def _reference(
    attn: Any, qk: mx.array, v: mx.array, rows: int, offset: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """blocks.py's ops for one token a row: what the kernel must give."""
    both = attn.rope(qk.reshape(rows, attn.n_heads + attn.n_kv_heads, 1, -1), offset=offset)
    q, k = mx.split(both, [attn.n_heads], axis=1)
    return q, k, v.reshape(rows, attn.n_kv_heads, 1, -1)


def test_the_pass_hands_the_decode_rows_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enabled, every layer's decode rows go through `rotated` with the rows'
    offsets (here MLX's own ops stand in for the kernel), prompt chunks
    never, and the pass computes what it does without."""
    calls: list[tuple[int, int]] = []

    def stand_in(
        attn: Any, qk: mx.array, v: mx.array, rows: int, offset: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        calls.append((rows, qk.shape[0]))
        return _reference(attn, qk, v, rows, offset)

    mx.random.seed(5)
    model = llama.Model(llama.ModelArgs(model_type="llama", **SMALL_BLOCK))
    mx.eval(model.parameters())
    join_projections(model)
    monkeypatch.setattr(dr, "rotated", stand_in)
    monkeypatch.setattr(dr, "_enabled", True)
    for layer in model.model.layers:
        monkeypatch.setitem(
            dr._cases, id(layer.self_attn.rope), dr.rope_case(layer.self_attn.rope, 16)
        )

    def run(rotary: bool) -> list[mx.array]:
        decode = [BatchKVCache([0, 2, 1]) for _ in model.model.layers]
        prompt = [BatchKVCache([0]) for _ in model.model.layers]
        model(mx.array([[5, 6, 7, 8, 9]] * 3), cache=decode)
        tokens = mx.array([[1], [2], [3]])
        monkeypatch.setattr(dr, "suspended", not rotary)
        out = fused_hidden(model, [(tokens, decode), (mx.array([list(range(9))]), prompt)])
        return [logits_of(model, h) for h in out]

    ours, theirs = run(True), run(False)
    assert calls == [(3, 3)] * len(model.model.layers)  # each layer's decode rows, once
    for a, b in zip(ours, theirs, strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()
    with blocks.as_before():
        calls.clear()
        run(True)
        assert not calls  # session 38's pass keeps its own ops


@pytest.mark.skipif(not available(), reason="the kernel runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("rope", ["plain", "traditional", "llama3"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (32, 8, 128)])
def test_the_kernel_rotates_as_mlx_does_on_cuda(
    dtype: Any, rope: str, heads: int, kv_heads: int, dim: int
) -> None:
    """From the joined projection's views of 5 rows (a row slice of a longer
    output, as a fused pass's decode group is), at offsets from 0 to 7,000:
    MLX's rotation within rounding, v exactly."""
    module: Any = {
        "plain": nn.RoPE(dim, base=1000000.0),
        "traditional": nn.RoPE(dim, traditional=True, scale=0.25),
        "llama3": Llama3RoPE(dim, base=500000.0, scaling_config=LLAMA3),
    }[rope]
    attn = _attn(module, heads, kv_heads)
    mx.random.seed(1)
    out = mx.random.normal((9, (heads + 2 * kv_heads) * dim)).astype(dtype)[2:7]
    qk, v = mx.split(out, [(heads + kv_heads) * dim], axis=-1)
    offset = mx.array([0, 1, 255, 4096, 7000], dtype=mx.int32)
    case = dr.rope_case(module, dim)
    assert case is not None
    dr._cases[id(module)] = case
    try:
        got = dr.rotated(attn, qk, v, 5, offset)
    finally:
        dr._cases.pop(id(module))
    want = _reference(attn, qk, v, 5, offset)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    for a, b in zip(got[:2], want[:2], strict=True):
        assert a.shape == b.shape
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tol, rtol=tol).item()
    assert mx.array_equal(got[2], want[2]).item()
