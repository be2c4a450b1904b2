"""worker/backend.py: the per-backend MLX settings a worker process starts with."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.backend import (
    CUDA_GRAPHS_ENV,
    MLX_ENV_DEFAULTS,
    PTX_CACHE_ENV,
    allocated_bytes,
    apply_env,
    decode_rows,
    fused_step,
    parse_buckets,
)

NAMES = (CUDA_GRAPHS_ENV, PTX_CACHE_ENV, *MLX_ENV_DEFAULTS)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cuda_defaults_turn_off_cudnn_attention_and_the_thrashing_check(
    clean_env: pytest.MonkeyPatch,
) -> None:
    import os

    apply_env("auto")
    assert os.environ["MLX_CUDA_USE_CUDNN_SDPA"] == "0"
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    assert os.environ[CUDA_GRAPHS_ENV] == "0"


def test_graph_mode_follows_the_setting(clean_env: pytest.MonkeyPatch) -> None:
    import os

    apply_env("on")
    assert os.environ[CUDA_GRAPHS_ENV] == "1"


def test_the_users_variables_win(clean_env: pytest.MonkeyPatch) -> None:
    import os

    clean_env.setenv("MLX_CUDA_USE_CUDNN_SDPA", "1")
    clean_env.setenv(CUDA_GRAPHS_ENV, "1")
    apply_env("off")
    assert os.environ["MLX_CUDA_USE_CUDNN_SDPA"] == "1"
    assert os.environ[CUDA_GRAPHS_ENV] == "1"


def test_mlx_kernels_are_kept_in_mlxds_cache_per_mlx_version(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """MLX's default, /tmp/mlx/<version>/ptx, is emptied at every start of a
    systemd unit with PrivateTmp: the kernels go to mlxd's cache directory,
    under the MLX version (MLX adds none to a directory it is given)."""
    import importlib.metadata
    import os

    apply_env("auto", tmp_path)
    kept = Path(os.environ[PTX_CACHE_ENV])
    assert kept == tmp_path / "mlx-ptx" / importlib.metadata.version("mlx")
    clean_env.setenv(PTX_CACHE_ENV, "/srv/ptx")  # the user's choice wins
    apply_env("auto", tmp_path)
    assert os.environ[PTX_CACHE_ENV] == "/srv/ptx"


def test_bad_graph_mode_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError):
        apply_env("sometimes")


def test_auto_fuses_on_a_single_cuda_worker_only() -> None:
    """Measured on the H200 (session 15): fused on for one CUDA worker; the CPU,
    Metal and worker groups keep two passes; "on" and "off" are obeyed."""
    assert fused_step("auto", "cuda")
    assert not fused_step("auto", "cuda", group_size=2)
    assert not fused_step("auto", "cpu") and not fused_step("auto", "metal")
    assert fused_step("on", "cpu") and not fused_step("off", "cuda")


def test_pacing_factor_zero_means_the_backends() -> None:
    """3 on the CPU (session 43: the long prompt's TTFT under mixed pressure
    2.35x idle at 2, 1.50x at 3), 2 on CUDA and Metal; a factor the user
    gives is obeyed everywhere."""
    from protocol.worker_config import WorkerConfig
    from worker.core import scheduler_config

    cfg = WorkerConfig(socket="s", model="m")
    assert cfg.pacing_factor == 0
    factors = {b: scheduler_config(cfg, b).pacing_factor for b in ("cpu", "metal", "cuda")}
    assert factors == {"cpu": 3.0, "metal": 2.0, "cuda": 2.0}
    given = WorkerConfig(socket="s", model="m", pacing_factor=2.5)
    assert {scheduler_config(given, b).pacing_factor for b in ("cpu", "cuda")} == {2.5}


def test_prompt_attention_is_off_unless_asked_and_the_runner_sets_it(
    tiny_model_dir: Path,
) -> None:
    """Unmeasured on a GPU and no faster on this CPU (docs/benchmarks/README.md,
    session 44): "auto" is MLX's call everywhere. The worker's runner sets
    the process's choice as asked."""
    from protocol.worker_config import WorkerConfig
    from worker import prompt_attention as module
    from worker.backend import uses_prompt_attention
    from worker.core import runner_for

    assert not any(uses_prompt_attention("auto", b) for b in ("cpu", "metal", "cuda"))
    assert all(uses_prompt_attention("on", b) for b in ("cpu", "metal", "cuda"))
    assert not uses_prompt_attention("off", "cuda")
    try:
        for asked, want in (("on", True), ("auto", False), ("on", True), ("off", False)):
            cfg = WorkerConfig(socket="s", model=str(tiny_model_dir), prompt_attention=asked)
            runner_for(cfg, tiny_model_dir).close()
            assert module.enabled is want
    finally:
        module.enabled = False


def test_decode_rows_is_off_unless_asked() -> None:
    """On an H100 (session 36) it made decode steps dearer (docs/benchmarks/README.md)."""
    assert not any(decode_rows("auto", b) for b in ("cpu", "metal", "cuda"))
    assert decode_rows("on", "cpu") and decode_rows("on", "cuda")
    assert not decode_rows("off", "cuda")


def test_buckets_parse() -> None:
    assert parse_buckets("1024, 64,256,64") == (64, 256, 1024)
    assert parse_buckets("") == ()
    with pytest.raises(ValueError):
        parse_buckets("0,64")


@pytest.mark.parametrize(("backend", "expected"), [("cuda", 0.0005), ("cpu", None)])
def test_worker_gil_switch_interval_per_backend(
    monkeypatch: pytest.MonkeyPatch, backend: str, expected: float | None
) -> None:
    """On CUDA the worker hands the GIL back to its engine thread sooner (worker/backend.py)."""
    import sys

    import worker.runner
    from worker.proc import _set_switch_interval

    before = sys.getswitchinterval()
    monkeypatch.setattr(worker.runner, "backend_name", lambda: backend)
    try:
        _set_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(expected or before)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize(("backend", "capped"), [("cuda", True), ("cpu", False)])
def test_the_worker_caps_mlx_memory_at_its_budget_on_cuda(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, backend: str, capped: bool
) -> None:
    """On CUDA, MLX's (soft) memory limit is the worker's budget, so freed buffers
    it caches never push it past its share of a device other processes use;
    elsewhere MLX keeps its own default (worker/backend.py)."""
    import mlx.core as mx

    import worker.core
    from protocol.worker_config import WorkerConfig
    from worker.runner import Runner

    runner = Runner(tiny_model_dir, max_batch=4, prefill_batch=2, prefill_chunk=64)
    monkeypatch.setattr(worker.core, "backend_name", lambda: backend)
    before = mx.get_memory_limit()
    budget = 3 << 30
    try:
        cfg = WorkerConfig(socket="", model=str(tiny_model_dir), memory_budget_bytes=budget)
        core = worker.core.core_for(cfg, runner)
        assert core.governor.config.budget_bytes == budget
        assert mx.get_memory_limit() == (budget if capped else before)
    finally:
        mx.set_memory_limit(before)
        runner.close()


def test_allocated_bytes_follows_each_backends_allocator() -> None:
    """MLX v0.32's allocators: CUDA rounds to 16 KiB pages and, below a page,
    to a power of two; Metal to pages above one; the CPU charges what was asked."""
    page = 16384
    assert [allocated_bytes(n, "cuda") for n in (1, 100, page, page + 1, 5 * page)] == [
        8,
        128,
        page,
        2 * page,
        5 * page,
    ]
    assert [allocated_bytes(n, "metal") for n in (100, page, page + 1)] == [100, page, 2 * page]
    assert [allocated_bytes(n, "cpu") for n in (0, 100, page + 1)] == [0, 100, page + 1]
