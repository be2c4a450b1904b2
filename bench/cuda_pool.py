"""How much freed device memory CUDA's stream-ordered pool keeps for reuse
(bench.alloc_probe's `--keep-freed`; the worker does not touch the pool).

MLX's CUDA allocator (v0.32, mlx/backend/cuda/allocator.cpp) takes every
buffer its own cache cannot serve from the device's default memory pool
(`cudaMallocAsync`), and gives buffers back to that pool (`cudaFreeAsync`)
when it trims its cache. MLX leaves the pool's release threshold at CUDA's
default, zero: at every synchronisation the pool hands its unused memory back
to the driver, so the next allocation the cache misses maps fresh memory.
Others met that default: RMM's async memory resources and cuda.core's device
memory resource raise the threshold (rapidsai/rmm#2512, NVIDIA/cuda-python#771),
and a llama.cpp pull request asks for it (#5429: 300-400 ms to allocate a 16
GB KV cache again after freeing one, against 10-20 ms the first time).

Session 36 tried it in the worker (`cuda_keep_freed`, the threshold at the
memory budget) on the H200, llama8b, through mlxd, on and off alternated
twice: sustained decode 1,685 / 1,680 tok/s against 1,657 / 1,660, the
long prompt's idle TTFT 86.6 / 87.0 ms against 83.8 / 84.2, the
mixed-pressure gap 3.07 / 2.37x against 2.46 / 2.82x. Nothing moved beyond
a few percent, and not all one way, so the setting was taken out again; the
probe's growths were 1-2 ms dearer fresh than from MLX's cache either way
(docs/benchmarks/README.md, session 36).

`keep_freed(nbytes)` raises the threshold of every visible device's default
pool to `nbytes` through the driver API (libcuda), which every CUDA process
has; a machine without it returns False and changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("mlxd.bench.cuda_pool")

# CUmemPool_attribute (cuda.h): CU_MEMPOOL_ATTR_RELEASE_THRESHOLD.
_RELEASE_THRESHOLD = 4


def _driver() -> ctypes.CDLL | None:
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _pool(lib: ctypes.CDLL, ordinal: int) -> ctypes.c_void_p | None:
    """Device `ordinal`'s default memory pool (None: a driver error)."""
    device = ctypes.c_int(0)
    pool = ctypes.c_void_p(0)
    if lib.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return None
    if lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device) != 0:
        return None
    return pool


def _devices(lib: ctypes.CDLL) -> int:
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def keep_freed(nbytes: int) -> bool:
    """Let each visible device's default memory pool keep up to `nbytes` of
    freed memory across synchronisations (module docstring). Whether every
    device's pool took it."""
    lib = _driver()
    if lib is None or nbytes <= 0:
        return False
    count = _devices(lib)
    threshold = ctypes.c_uint64(int(nbytes))
    for ordinal in range(count):
        pool = _pool(lib, ordinal)
        if pool is None:
            return False
        err = lib.cuMemPoolSetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(threshold))
        if err != 0:
            log.warning("cuda_pool: device %d: driver error %d", ordinal, err)
            return False
    return count > 0


def release_threshold(ordinal: int = 0) -> int | None:
    """The default pool's release threshold on device `ordinal` (None: unknown)."""
    lib = _driver()
    if lib is None or _devices(lib) <= ordinal:
        return None
    pool = _pool(lib, ordinal)
    value = ctypes.c_uint64(0)
    if pool is None or lib.cuMemPoolGetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(value)):
        return None
    return int(value.value)
