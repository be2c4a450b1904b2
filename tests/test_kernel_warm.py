"""worker/kernel_warm.py: the helpers that compile MLX's CUDA kernels beside the
worker's load. Here (no CUDA) the pieces run on MLX's CPU backend in real
processes, which writes no PTX: the tests check that every piece is a valid
call into the library code, the marker, the failure path, and the move of a
module's files into the cache with real files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from worker import kernel_warm


def _cache(tmp_path: Path) -> Path:
    cache = tmp_path / "ptx"
    cache.mkdir()
    return cache


def _interpreter(tmp_path: Path, name: str, script: str) -> str:
    """A stand-in for the helpers' Python: a shell script that runs `script`."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


def _slow_python(tmp_path: Path) -> str:
    return _interpreter(tmp_path, "slow-python", "exec sleep 30")


def _no_private_dirs(cache: Path) -> bool:
    work = cache / kernel_warm.WORK_DIR
    return not work.exists() or not any(work.rglob("*"))


def test_every_piece_runs_in_its_own_process_and_the_marker_ends_the_next_start(
    tmp_path: Path,
) -> None:
    cache = _cache(tmp_path)
    helpers = kernel_warm.start(cache, "bfloat16")
    assert helpers is not None
    assert set(helpers.procs) == set(kernel_warm.PIECES)
    assert len({p.pid for p in helpers.procs.values()}) == len(kernel_warm.PIECES)
    helpers.merge(wait_s=120.0)
    assert helpers.done and helpers.failed == []
    assert sorted(helpers.merged) == sorted(kernel_warm.PIECES)
    mark = kernel_warm.marker(cache, "bfloat16")
    assert mark.read_text().split() == sorted(kernel_warm.PIECES)
    assert _no_private_dirs(cache)
    assert kernel_warm.start(cache, "bfloat16") is None  # the cache has them
    other = kernel_warm.start(cache, "float16")  # another dtype is other modules
    assert other is not None
    other.merge(wait_s=120.0)
    assert other.failed == []


def test_a_failed_piece_leaves_no_marker_so_the_next_start_tries_again(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    failing = _interpreter(tmp_path, "failing-python", "exit 3")
    helpers = kernel_warm.start(cache, "bfloat16", python=failing)
    assert helpers is not None
    helpers.merge(wait_s=30.0)
    assert sorted(helpers.failed) == sorted(kernel_warm.PIECES) and helpers.merged == []
    assert not kernel_warm.marker(cache, "bfloat16").exists()
    again = kernel_warm.start(cache, "bfloat16")
    assert again is not None
    again.merge(wait_s=120.0)
    assert again.failed == []


def test_a_helper_that_cannot_start_stops_the_others_and_raises(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    with pytest.raises(OSError):
        kernel_warm.start(cache, "bfloat16", python=sys.executable + "-missing")
    assert _no_private_dirs(cache)


def test_a_helper_not_done_by_the_deadline_is_stopped_and_counts_as_failed(
    tmp_path: Path,
) -> None:
    cache = _cache(tmp_path)
    helpers = kernel_warm.start(cache, "bfloat16", python=_slow_python(tmp_path))
    assert helpers is not None
    assert helpers.merge() == 0 and not helpers.done  # no wait: nothing finished yet
    helpers.merge(wait_s=0.2)
    assert helpers.done and sorted(helpers.failed) == sorted(kernel_warm.PIECES)
    assert not kernel_warm.marker(cache, "bfloat16").exists()


def _module(root: Path, name: str, text: str) -> None:
    ptx = root / f"{name}.ptx"
    ptx.parent.mkdir(parents=True, exist_ok=True)
    ptx.write_text(text)
    ptx.with_suffix(".txt").write_text(f"{name}\tmangled_{name}\n")
    ptx.with_suffix(".cu").write_text("// source\n")


def test_modules_move_whole_and_the_cache_keeps_what_it_has(tmp_path: Path) -> None:
    src, cache = tmp_path / "helper", tmp_path / "cache"
    _module(src, "gather_bfloat16_int32_1", "new")
    _module(src, "a" * 245 + "/rest_of_a_long_name", "long")  # MLX nests long names
    _module(src, "scatter_bfloat16_int64_Sum_2", "new")
    _module(cache, "scatter_bfloat16_int64_Sum_2", "kept")
    assert kernel_warm.move_modules(src, cache) == 2
    for name in ("gather_bfloat16_int32_1", "a" * 245 + "/rest_of_a_long_name"):
        ptx = cache / f"{name}.ptx"
        assert ptx.read_text() in ("new", "long")
        assert ptx.with_suffix(".txt").read_text().startswith(name + "\t")
        assert ptx.with_suffix(".cu").exists()
    assert (cache / "scatter_bfloat16_int64_Sum_2.ptx").read_text() == "kept"


def test_the_dtype_comes_from_the_models_config(tmp_path: Path) -> None:
    assert kernel_warm.model_dtype(tmp_path) is None  # no config
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert kernel_warm.model_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert kernel_warm.model_dtype(tmp_path) == "float16"
    for bad in ({"torch_dtype": "int4"}, [1, 2], {}):
        (tmp_path / "config.json").write_text(json.dumps(bad))
        assert kernel_warm.model_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert kernel_warm.model_dtype(tmp_path) is None


def test_the_command_line_runs_one_piece_and_refuses_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert kernel_warm.main(["embed", "float32"]) == 0
    assert kernel_warm.main(["no_such_piece", "bfloat16"]) == 2
    assert kernel_warm.main(["embed", "int8"]) == 2
    assert "usage" in capsys.readouterr().err


def test_stale_private_directories_of_gone_workers_are_removed(tmp_path: Path) -> None:
    cache = tmp_path / "ptx"
    gone = cache / kernel_warm.WORK_DIR / "999999999" / "embed"  # no such pid
    live = cache / kernel_warm.WORK_DIR / "1" / "embed"  # init: alive
    for d in (gone, live):
        d.mkdir(parents=True)
        (d / "half.ptx").write_text("x")
    helpers = kernel_warm.start(cache, "bfloat16")
    assert helpers is not None
    helpers.stop()
    assert not gone.parent.exists() and live.exists()


def test_a_worker_whose_load_fails_leaves_no_helper_running(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protocol.worker_config import FAULTS_ENV, LOAD_NO_MEMORY_ENV, WorkerConfig
    from worker.proc import Worker

    cache = _cache(tmp_path)
    started: list[kernel_warm.Helpers] = []

    def start(self: Worker, model_path: Path) -> kernel_warm.Helpers | None:
        helpers = kernel_warm.start(cache, "bfloat16", python=_slow_python(tmp_path))
        assert helpers is not None
        started.append(helpers)
        return helpers

    monkeypatch.setattr(Worker, "_start_kernel_warm", start)
    fault = tmp_path / "load-fails"
    fault.write_text("")
    monkeypatch.setenv(FAULTS_ENV, "1")
    monkeypatch.setenv(LOAD_NO_MEMORY_ENV, str(fault))
    worker = Worker(WorkerConfig(socket=str(tmp_path / "w.sock"), model=str(tiny_model_dir)))
    with pytest.raises(RuntimeError, match="out of memory"):
        worker._load()
    (helpers,) = started
    assert helpers.done and _no_private_dirs(cache)


def test_a_worker_merges_its_helpers_before_its_warm_up(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's own path (here the pieces run on the CPU backend): the
    helpers it started are all merged by the time its load returns, and the
    cache's marker then stops the next start."""
    from protocol.worker_config import WorkerConfig
    from worker.proc import Worker

    cache = _cache(tmp_path)
    started: list[kernel_warm.Helpers] = []

    def start(self: Worker, model_path: Path) -> kernel_warm.Helpers | None:
        helpers = kernel_warm.start(cache, kernel_warm.model_dtype(model_path) or "bfloat16")
        assert helpers is not None
        started.append(helpers)
        return helpers

    monkeypatch.setattr(Worker, "_start_kernel_warm", start)
    cfg = WorkerConfig(
        socket=str(tmp_path / "w.sock"), model=str(tiny_model_dir), pacing_calibration_s=0.0
    )
    core = Worker(cfg)._load()
    try:
        (helpers,) = started
        assert helpers.done and helpers.failed == []
        assert sorted(helpers.merged) == sorted(kernel_warm.PIECES)
        assert kernel_warm.marker(cache, helpers.dtype).exists()
    finally:
        core.runner.close()
