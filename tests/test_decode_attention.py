"""worker/decode_attention.py: which calls the CUDA decode kernel takes, how it
is put in place of mlx-lm's attention, and (on a CUDA machine only) that it
gives mlx-lm's attention."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache

from protocol.worker_config import WorkerConfig
from worker import decode_attention as da
from worker import fused
from worker.backend import ragged_decode
from worker.fused import FusedGenerator
from worker.runner import Runner


def _call(
    rows: int = 3, length: int = 1, dim: int = 64, keys: int = 40, dtype: Any = mx.bfloat16
) -> tuple[mx.array, mx.array, Any]:
    q = mx.zeros((rows, 8, length, dim), dtype)
    k = mx.zeros((rows, 2, keys, dim), dtype)
    mask = mx.ones((rows, 1, length, keys), dtype=mx.bool_)
    return q, k, mask


def test_a_batched_decode_call_with_a_boolean_mask_is_the_kernels() -> None:
    q, k, mask = _call()
    assert da.eligible(q, k, mask, None, object())
    assert da.eligible(q, k, mask[:1], None, object())  # one mask row for all
    assert da.eligible(*_call(dim=128, dtype=mx.float16), None, object())


@pytest.mark.parametrize(
    "why",
    ["prompt", "no mask", "causal", "float mask", "head dim", "sinks", "quantized", "too long"],
)
def test_every_other_call_stays_mlx_lms(why: str) -> None:
    q, k, mask = _call(length=4 if why == "prompt" else 1, dim=96 if why == "head dim" else 64)
    if why == "too long":
        q, k, mask = _call(keys=da.MAX_KEYS + 1)
    cache: Any = type("Quantized", (), {"bits": 8})() if why == "quantized" else object()
    m: Any = {"no mask": None, "causal": "causal", "float mask": mask.astype(mx.bfloat16)}.get(
        why, mask
    )
    sinks = mx.zeros((8,)) if why == "sinks" else None
    assert not da.eligible(q, k, m, sinks, cache)


def test_keys_may_be_a_longer_buffer_whose_mask_says_which_count() -> None:
    q, k, mask = _call(keys=48)
    assert da.eligible(q, k, mask[..., :40], None, object())
    assert not da.eligible(q, k[:, :, :30], mask[..., :40], None, object())  # keys short


def test_a_buffer_longer_than_the_mask_reaches_mlx_lms_attention_cut() -> None:
    """Where the kernel does not take a call (a head size it lacks), whole
    buffers are cut to the mask before mlx-lm's function sees them."""
    q = mx.random.normal((2, 4, 1, 96))
    k, v = mx.random.normal((2, 2, 12, 96)), mx.random.normal((2, 2, 12, 96))
    mask = mx.array([[True] * 9, [False] * 3 + [True] * 6]).reshape(2, 1, 1, 9)
    ours = da.attention(q, k, v, cache=None, scale=0.25, mask=mask)
    cut = da.MLX_LM_ATTENTION(q, k[:, :, :9], v[:, :, :9], cache=None, scale=0.25, mask=mask)
    assert mx.array_equal(ours, cut)
    flat = da.attention(q, k, v, cache=None, scale=0.25, mask=mask, flat=True)
    assert mx.array_equal(flat, cut.reshape(2, 4 * 96))


def test_whole_buffers_go_only_to_the_kernels_attention() -> None:
    assert not da.takes_buffers()
    try:
        da.install(lambda *a, **kw: None)  # some other function in place
        assert not da.takes_buffers()
        da.install()
        assert da.takes_buffers()
    finally:
        da.uninstall()
    assert not da.takes_buffers()


def test_other_calls_get_mlx_lms_own_result() -> None:
    q = mx.random.normal((2, 4, 5, 16))
    k = mx.random.normal((2, 2, 9, 16))
    v = mx.random.normal((2, 2, 9, 16))
    ours = da.attention(q, k, v, cache=None, scale=0.25, mask="causal")
    theirs = da.MLX_LM_ATTENTION(q, k, v, cache=None, scale=0.25, mask="causal")
    assert mx.array_equal(ours, theirs)


def test_install_replaces_the_imported_names_and_uninstall_restores_them() -> None:
    import mlx_lm.models.llama as llama
    from mlx_lm.models import base

    def spy(*args: Any, **kwargs: Any) -> Any:
        return da.MLX_LM_ATTENTION(*args, **kwargs)

    try:
        assert da.install(spy) >= 2
        assert llama.scaled_dot_product_attention is spy
        assert fused.scaled_dot_product_attention is spy
        assert base.scaled_dot_product_attention is da.MLX_LM_ATTENTION  # attention calls it
    finally:
        assert da.uninstall() >= 2
    assert llama.scaled_dot_product_attention is da.MLX_LM_ATTENTION
    assert fused.scaled_dot_product_attention is da.MLX_LM_ATTENTION
    assert da.uninstall() == 0  # nothing left to restore


@pytest.mark.parametrize("fuse", [False, True])
def test_decode_steps_of_rows_of_different_lengths_reach_the_kernel(
    tiny_model_dir: Path, fuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls a real decode step makes (mlx-lm's steps and the fused ones)
    are the ones `eligible` takes, with every row in one call; the tokens are
    mlx-lm's. The test model's heads are 16 wide, so 16 counts here."""
    monkeypatch.setattr(da, "HEAD_DIMS", (16, 64, 128))
    model = load(str(tiny_model_dir))[0]
    calls: list[tuple[bool, int, int]] = []

    def spy(q: mx.array, k: mx.array, v: mx.array, cache: Any, scale: float, mask: Any) -> Any:
        calls.append((da.eligible(q, k, mask, None, cache), q.shape[0], q.shape[2]))
        return da.MLX_LM_ATTENTION(q, k, v, cache=cache, scale=scale, mask=mask)

    prompts = [[(7 * j + r) % 400 + 3 for j in range(n)] for r, n in enumerate((5, 23, 61))]
    kw: dict[str, Any] = dict(
        stop_tokens=[], completion_batch_size=4, prefill_batch_size=4, prefill_step_size=32
    )

    def tokens(gen: Any) -> list[list[int]]:
        uids = gen.insert(prompts, max_tokens=[6] * 3)
        out: dict[int, list[int]] = {u: [] for u in uids}
        for _ in range(40):
            for r in gen.next()[1]:
                out[r.uid].append(int(r.token))
            if all(len(t) == 6 for t in out.values()):
                break
        return [out[u] for u in uids]

    reference = tokens(BatchGenerator(model, **kw))
    try:
        da.install(spy)
        ours = tokens(FusedGenerator(model, fuse=fuse, **kw))
    finally:
        da.uninstall()
    assert ours == reference
    decode = [c for c in calls if c[2] == 1 and c[1] == 3]
    assert decode and all(ok for ok, _, _ in decode)  # every 3-row decode call
    assert not any(ok for ok, _, length in calls if length > 1)  # prompt passes never


@pytest.mark.parametrize("fuse", [False, True])
def test_decode_steps_over_whole_buffers_give_mlx_lms_tokens(
    tiny_model_dir: Path, fuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernel's attention in place, `fused_hidden`'s decode passes write the
    caches in place and hand it whole buffers (worker/fused.py, `next_offsets`)
    through buffers that grow (16-slot steps here): greedy tokens are
    mlx-lm's. The kernel's arithmetic is MLX's over the keys the mask counts
    (it runs on CUDA only; its own test is below)."""
    monkeypatch.setattr(da, "HEAD_DIMS", (16, 64, 128))
    monkeypatch.setattr(BatchKVCache, "step", 16)
    longer: list[int] = []

    def kernel(
        q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, flat: bool = False
    ) -> mx.array:
        n = mask.shape[-1]
        longer.append(k.shape[2] - n)
        out = da.MLX_LM_ATTENTION(q, k[:, :, :n], v[:, :, :n], cache=None, scale=scale, mask=mask)
        return out.reshape(out.shape[0], -1) if flat else out

    monkeypatch.setattr(da, "ragged_attention", kernel)
    model = load(str(tiny_model_dir))[0]
    prompts = [[(7 * j + r) % 400 + 3 for j in range(n)] for r, n in enumerate((5, 23, 61))]
    kw: dict[str, Any] = dict(
        stop_tokens=[], completion_batch_size=4, prefill_batch_size=4, prefill_step_size=32
    )

    lengths = [40, 21, 33]  # rows leave the batch at different steps (its filter)

    def tokens(gen: Any) -> list[list[int]]:
        uids = gen.insert(prompts, max_tokens=lengths)
        out: dict[int, list[int]] = {u: [] for u in uids}
        for _ in range(200):
            for r in gen.next()[1]:
                out[r.uid].append(int(r.token))
            if [len(out[u]) for u in uids] == lengths:
                break
        return [out[u] for u in uids]

    reference = tokens(BatchGenerator(model, **kw))
    try:
        da.install()
        ours = tokens(FusedGenerator(model, fuse=fuse, **kw))
    finally:
        da.uninstall()
    assert ours == reference
    # buffers with room past the mask, where decode passes are fused_hidden's
    # (`lean_decode`); the model's own forward hands over slices
    assert any(n > 0 for n in longer) == fuse


def test_the_setting_acts_on_cuda_only() -> None:
    assert ragged_decode("auto", "cuda")  # measured on the H200 (worker/backend.py)
    assert ragged_decode("ragged", "cuda") and not ragged_decode("mlx", "cuda")
    assert not ragged_decode("ragged", "cpu") and not ragged_decode("ragged", "metal")
    with pytest.raises(ValueError, match="decode_attention"):
        WorkerConfig(socket="", model="m", decode_attention="fast").validate()


def test_a_block_takes_the_query_heads_of_one_kv_head_that_fit() -> None:
    assert da.shared_heads(32, 8, 128) == 4  # the 8B shape
    assert da.shared_heads(14, 2, 64) == 7  # the 0.5B shape
    assert da.shared_heads(64, 4, 128) == 8  # 16 a KV head: what fits
    assert da.shared_heads(48, 4, 64) == 12
    assert da.shared_heads(8, 8, 128) == 1  # no grouping to share


def test_the_check_runs_at_the_models_own_shape(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel is compiled per dtype and head size: the runner's check must
    build the instantiation the model's decode steps will use."""
    from mlx_lm import load

    from worker.runner import _use_decode_kernel

    model = load(str(tiny_model_dir))[0]
    attn = model.model.layers[0].self_attn
    case = da.model_case(model)
    assert case == (
        model.model.norm.weight.dtype,
        attn.k_proj.weight.shape[0] // attn.n_kv_heads,
        attn.n_heads,
        attn.n_kv_heads,
    )
    asked: list[Any] = []

    def works(*case: Any) -> bool:
        asked.append(case)
        return False

    monkeypatch.setattr(da, "available", lambda: True)
    monkeypatch.setattr(da, "works", works)
    assert not _use_decode_kernel(True, model)
    assert asked == [(case,)] if case is not None and case[1] in da.HEAD_DIMS else [()]
    assert da.model_case(object()) is None


def test_a_runner_asked_for_the_kernel_without_cuda_keeps_mlx_lms(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import mlx_lm.models.llama as llama

    if da.available():
        pytest.skip("this machine has MLX's CUDA backend")
    with caplog.at_level(logging.WARNING, logger="worker.runner"):
        runner = Runner(tiny_model_dir, max_batch=4, prefill_batch=2, ragged_decode=True)
    assert not runner.ragged_decode
    assert llama.scaled_dot_product_attention is da.MLX_LM_ATTENTION
    assert "needs MLX's CUDA backend" in caplog.text
    runner.close()


def test_a_kernel_that_fails_its_check_leaves_mlx_lms_attention(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU whose compiler rejects the kernel costs the worker the kernel, not
    its start: the runner's choice checks it first (worker/runner.py)."""
    import mlx_lm.models.llama as llama

    from worker.runner import _use_decode_kernel

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("[cuda_kernel] NVRTC compilation failed")

    monkeypatch.setattr(da, "available", lambda: True)
    monkeypatch.setattr(da, "ragged_attention", broken)
    with caplog.at_level(logging.WARNING):
        assert not _use_decode_kernel(True, None)
    assert llama.scaled_dot_product_attention is da.MLX_LM_ATTENTION
    assert "failed its check" in caplog.text and "NVRTC" in caplog.text
    monkeypatch.setattr(
        da,
        "ragged_attention",
        lambda q, k, v, mask, scale, flat=False: da.MLX_LM_ATTENTION(
            q, k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]], None, scale, mask
        ).reshape((q.shape[0], -1) if flat else q.shape),
    )
    try:
        assert _use_decode_kernel(True, None)  # one that gives MLX's answer is put in place
        assert llama.scaled_dot_product_attention is da.attention
    finally:
        da.uninstall()


def test_the_gateway_refuses_an_unknown_decode_attention() -> None:
    from gateway.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="decode_attention"):
        load_settings(decode_attention="fast")


@pytest.mark.skipif(not da.available(), reason="the kernel runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (14, 2), (4, 4)])
def test_the_kernel_gives_mlx_lms_attention_on_cuda(
    dim: int, dtype: Any, heads: int, kv_heads: int
) -> None:
    """Rows left-padded as a BatchKVCache holds them (one row 2,000 keys long
    beside rows of 40-500), keys sliced from a longer buffer as the cache
    hands them out, 4 and 7 query heads a KV head and none shared: mlx-lm's
    attention within rounding."""
    rows, buffer, keys = 5, 2304, 2001
    mx.random.seed(0)
    q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    k_buffer = mx.random.normal((rows, kv_heads, buffer, dim)).astype(dtype)
    v_buffer = mx.random.normal((rows, kv_heads, buffer, dim)).astype(dtype)
    k, v = k_buffer[:, :, :keys], v_buffer[:, :, :keys]
    lengths = mx.array([2001, 40, 500, 1, 333])
    mask = (mx.arange(keys)[None] >= (keys - lengths)[:, None]).reshape(rows, 1, 1, keys)
    ours = da.ragged_attention(q, k, v, mask, scale=dim**-0.5)
    whole = da.ragged_attention(q, k_buffer, v_buffer, mask, scale=dim**-0.5)  # takes_buffers
    theirs = da.MLX_LM_ATTENTION(q, k, v, cache=None, scale=dim**-0.5, mask=mask)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), atol=tol, rtol=tol)
    assert mx.array_equal(whole, ours)
    flat = da.ragged_attention(q, k_buffer, v_buffer, mask, scale=dim**-0.5, flat=True)
    assert mx.array_equal(flat, ours.reshape(rows, heads * dim))
