"""MLX's CUDA kernels compiled in helper processes, side by side, while the
worker imports and loads its model.

MLX compiles each CUDA kernel with NVRTC the first time a process needs it
and keeps the PTX on disk (`MLX_PTX_CACHE_DIR`, worker/backend.py). On a
fresh machine (session 32, an H100, llama8b) the first worker compiled 11
modules of 2-4 s each, one after another: its warm-up took 27.7 s against
2.5 s for the next worker, which found them on disk. Their names carry the
dtype and the op, not the model's sizes (the 0.5B worker that came next
compiled none), so a few small calls into the same library code, in a dtype,
compile the same modules. Each piece below is one such call, and each runs
in a process of its own, so the compiles overlap each other and the worker's
own imports and weight load instead of following them.

Each helper writes into a private directory. MLX writes a module's files
with no atomic rename, so a process reading the shared directory while
another writes there could read half a file. The worker moves finished
helpers' files into its cache (`merge`): the .txt and .cu files first, the
.ptx last, each by an atomic rename. MLX looks a module up only by its .ptx,
so a module is either missing, and then compiled as before, or whole. A
marker file per dtype then says the pieces are in the cache, and later
starts spawn nothing.

A piece that fails, or is not done by the deadline, costs nothing but its
own work: the worker compiles what is missing, as it did before. Only for
CUDA, and only for a single worker (a group's ranks share one machine's cache
and would race to fill it; they compile as before).

Threading: the worker's main thread only (`start`, `Helpers.merge`).
`python -m worker.kernel_warm PIECE DTYPE` runs one piece in its own process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.backend import PTX_CACHE_ENV

log = logging.getLogger("mlxd.worker.kernel_warm")

DTYPES = ("bfloat16", "float16", "float32")
# Bumped when the pieces change, so a cache filled by older pieces is filled again.
PIECES_VERSION = 1
# The helpers' private directories, under the cache (one filesystem: renames are atomic).
WORK_DIR = ".mlxd-kernel-warm"


def _embed(mx: Any, dt: Any) -> None:
    # An embedding lookup: a row gather by int32 ids.
    table = mx.zeros((64, 32), dtype=dt)
    mx.eval(table[mx.array([1, 2, 3])])


def _library(relative: str) -> Any:
    """One of mlx-lm's own modules (a path in its package), loaded alone.
    Importing it as `mlx_lm.<name>` first runs mlx-lm's package __init__,
    which imports transformers: on session 32's H100, beside the other helpers
    and the worker's load, a helper that did took 15-20 s to its first compile
    against 6 s for one that did not. The two modules used here import only
    MLX, and a compiled function's kernels are named by its graph, not by the
    module it is defined in."""
    spec = importlib.util.find_spec("mlx_lm")  # finds the package, runs nothing
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mlx_lm is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    name = "_mlxd_kernel_warm_" + relative.replace("/", "_").removesuffix(".py")
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _mlp(mx: Any, dt: Any) -> None:
    swiglu = _library("models/activations.py").swiglu  # the MLP's compiled activation
    x = mx.ones((1, 4, 32), dtype=dt)
    mx.eval(swiglu(x, x))


def _ends(mx: Any, dt: Any) -> None:
    # The hidden state at each finished prompt's last position (worker/fused.py).
    hidden = mx.zeros((2, 8, 32), dtype=dt)
    mx.eval(hidden[mx.array([0, 1]), mx.array([3, 7])])


def _logit_bias(mx: Any, dt: Any) -> None:
    make_logits_processors = _library("sample_utils.py").make_logits_processors
    (bias,) = make_logits_processors(logit_bias={0: -1.0, 5: 1.0})
    mx.eval(bias(mx.array([1, 2]), mx.zeros((1, 64), dtype=dt)))  # the tokens so far: unread


def _top_p(mx: Any, dt: Any) -> None:
    # The filter alone: the categorical draw after it compiled four modules on
    # session 32's H100 that the worker's steps never asked for. Its constant
    # (0.9, the warm-up's top_p) is part of one module's name.
    apply_top_p = _library("sample_utils.py").apply_top_p
    logprobs = mx.random.normal((1, 64)).astype(dt)
    mx.eval(apply_top_p(logprobs, 0.9))


def _rows_int32(mx: Any, dt: Any) -> None:
    # A batch's per-row int32 state kept for the rows that stay.
    mx.eval(mx.array([4, 5, 6], dtype=mx.int32)[mx.array([0, 2])])


def _rows_uint32(mx: Any, dt: Any) -> None:
    # The sampled tokens (uint32) kept for the rows that stay.
    mx.eval(mx.array([4, 5, 6], dtype=mx.uint32)[mx.array([0, 2])])


def _by_token(mx: Any, dt: Any) -> None:
    # A value per sampled token: a gather by uint32 ids.
    mx.eval(mx.zeros((64,), dtype=dt)[mx.array([1, 2], dtype=mx.uint32)])


# The modules each compiles, as session 32's H100 listed them for bf16
# (docs/benchmarks/h100-session32/ptx-files.txt).
PIECES: dict[str, Callable[[Any, Any], None]] = {
    "top_p": _top_p,  # exp, >=, take_along_axis, where: four modules, the longest piece
    "logit_bias": _logit_bias,  # scatter_bfloat16_int64_Sum_2
    "mlp": _mlp,  # the fused silu(gate) * up
    "embed": _embed,  # gather_bfloat16_int32_1
    "ends": _ends,  # gather_bfloat16_int32_2
    "by_token": _by_token,  # gather_bfloat16_uint32_1
    "rows_int32": _rows_int32,  # gather_int32_int32_1
    "rows_uint32": _rows_uint32,  # gather_uint32_int32_1
}


def model_dtype(model_path: Path) -> str | None:
    """The dtype a model's config names (`torch_dtype`, or `dtype`), if it is
    one the pieces run in; None otherwise (then nothing is warmed)."""
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    return name if name in DTYPES else None


def marker(cache: Path, dtype: str) -> Path:
    return cache / f".mlxd-kernels-{dtype}-v{PIECES_VERSION}"


@dataclass
class Helpers:
    """The helper processes of one worker start, and where each writes."""

    cache: Path
    dtype: str
    work: Path  # the helpers' private directories' parent
    started: float
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    dirs: dict[str, Path] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)

    def merge(self, wait_s: float = 0.0) -> int:
        """Move the files of every helper that has finished (waiting up to
        `wait_s` for the rest) into the cache; past the wait, the helpers still
        running are stopped. Once none is left, the marker is written if every
        piece succeeded. Returns the modules moved."""
        deadline = time.monotonic() + wait_s
        moved = 0
        for name, proc in list(self.procs.items()):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if wait_s <= 0:
                    continue  # not yet: a later merge takes it
                proc.kill()
                proc.wait()
            del self.procs[name]
            if proc.returncode == 0:
                moved += move_modules(self.dirs[name], self.cache)
                self.merged.append(name)
            else:
                self.failed.append(name)
                log.warning("kernel warm-up piece %s failed (rc %s)", name, proc.returncode)
            shutil.rmtree(self.dirs[name], ignore_errors=True)
        if not self.procs:
            with contextlib.suppress(OSError):
                self.work.rmdir()
            if not self.failed:
                with contextlib.suppress(OSError):
                    marker(self.cache, self.dtype).write_text(" ".join(sorted(self.merged)))
        return moved

    def finish(self, within_s: float) -> str:
        """Merge the rest, waiting for them until `within_s` after they
        started; what happened, for the log."""
        waited = time.monotonic()
        self.merge(wait_s=max(0.0, within_s - (waited - self.started)))
        now = time.monotonic()
        return (
            f"{len(self.merged)} of {len(self.merged) + len(self.failed)} pieces in the cache "
            f"({','.join(self.failed) or 'none'} failed), {now - self.started:.2f}s after "
            f"they started, {now - waited:.2f}s of it waited for"
        )

    def stop(self) -> None:
        """End every helper still running and remove the private directories."""
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        self.procs.clear()
        shutil.rmtree(self.work, ignore_errors=True)

    @property
    def done(self) -> bool:
        return not self.procs


def start(cache: Path, dtype: str | None, python: str = sys.executable) -> Helpers | None:
    """Start one helper per piece for `dtype` unless the cache already holds
    them (its marker) or there is no dtype to warm. The helpers inherit this
    process's environment (worker/backend.py's MLX settings) but their own
    kernel cache directory."""
    if dtype is None or marker(cache, dtype).exists():
        return None
    _remove_stale(cache / WORK_DIR)
    work = cache / WORK_DIR / str(os.getpid())
    helpers = Helpers(cache, dtype, work, time.monotonic())
    # `python -m worker.kernel_warm` finds this package as this process did
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    try:
        for name in PIECES:
            private = work / name
            private.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, PTX_CACHE_ENV: str(private), "PYTHONPATH": path}
            helpers.dirs[name] = private
            helpers.procs[name] = subprocess.Popen(
                [python, "-m", "worker.kernel_warm", name, dtype],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
    except OSError:
        helpers.stop()
        raise
    return helpers


def _remove_stale(work: Path) -> None:
    """Remove the private directories of workers that are gone (one killed
    while its helpers ran never merged or removed them)."""
    if not work.is_dir():
        return
    for entry in work.iterdir():
        if entry.name.isdigit() and not _alive(int(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def move_modules(src: Path, cache: Path) -> int:
    """Move each module MLX wrote under `src` to the same place under `cache`,
    the .ptx last (module docstring), leaving any module the cache already
    has. Returns how many were moved."""
    moved = 0
    for ptx in sorted(src.rglob("*.ptx")):
        dest = cache / ptx.relative_to(src)
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        for side in (ptx.with_suffix(".txt"), ptx.with_suffix(".cu")):
            if side.exists():
                os.replace(side, dest.with_suffix(side.suffix))
        os.replace(ptx, dest)
        moved += 1
    return moved


def run_piece(name: str, dtype: str) -> None:
    import mlx.core as mx

    PIECES[name](mx, getattr(mx, dtype))
    mx.synchronize()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in PIECES or argv[1] not in DTYPES:
        print(f"usage: python -m worker.kernel_warm {{{','.join(PIECES)}}} DTYPE", file=sys.stderr)
        return 2
    run_piece(argv[0], argv[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
