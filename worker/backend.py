"""What differs per MLX backend (CPU, Metal, CUDA), in one place.

No MLX import at module level: `apply_env` must run before MLX is first
imported (MLX reads its CUDA settings from the environment once).

- CUDA graphs (`cuda_graphs`: "auto", "on", "off"): "auto" turns them off on
  CUDA. Measured on the H200 (issue #12, /work/shared/gpu.md): with graphs on,
  every prefill pass of a new shape, which is every paced step, cost 60-90 ms
  against a 7-8 ms decode step, and batched decode at 16-64 rows was 20-35%
  slower; off, a warm 1,023-token paced pass cost 16 ms. Off costs about 7% of
  decode rate at batch 1 on the 0.5B shape. Re-measured through mlxd with
  cuDNN attention off (session 5, docs/benchmarks/README.md): graphs on gave
  a 5.1x mixed-pressure gap against 1.8x, and 26-29% less throughput at C=32
  and 64; only C=1 was faster. Measured once more in session 39 on an H100,
  now that padded passes keep prefill shapes few (docs/benchmarks/README.md):
  on the 0.5B shape graphs on gave 4.97-5.20x mixed-pressure gaps against
  1.42-2.33x, and 12-18% less throughput at C=16 (3-4% at C=64); on the
  8B shape the longest gap 47-66 ms against 31-32. A variable the user
  already set wins. CPU and
  Metal ignore the variable. The mode is per process, not per step kind:
  MLX reads the variable once (a function-local static in
  mlx/backend/cuda/device.cpp, v0.32), so graphs for decode-only steps and
  none for prefill steps would need a change to MLX itself.
- cuDNN attention (CUDA only): off unless `MLX_CUDA_USE_CUDNN_SDPA` is set.
  MLX builds a cuDNN SDPA plan for every new (rows, query length, key length,
  KV buffer size) of a prefill pass, held per process: on the H200 (issue
  #12) each new prompt length cost 60-100 ms more than a warm one (at times
  550 ms with graphs on), so with real traffic nearly every prompt paid it.
  Off, prefill attention is MLX's own matmul and softmax: a new length costs
  1-20 ms more, a warm 300-1,000-token pass the same 19-28 ms, a 2,000-token
  one 29-39 ms against 27-31 (bench `diag2`, docs/benchmarks/h200-qwen0.5b-engine).
  (The earlier finding that cuDNN "was not the cause" used a misspelt
  variable, `..._SPDA`, which MLX ignores.) Re-measured on the 8B shape
  with padded passes (session 20, docs/benchmarks/h200-session20): warm,
  cuDNN's is faster for mlx-lm's own unpadded 2,000-token pass (47 against
  73 ms) but not for the worker's padded one (70 against 72), and each new
  shape still cost 50-800 ms; through mlxd it lost everywhere (warm-up 19 s,
  long-prompt TTFT 146 against 108 ms, mixed-pressure gap 5.7x against
  2.6x, shared prefix 1.45x against 3.1x).
- MLX's shape-keyed caches (the cuDNN plans, CUDA graph executables) throw
  "cache thrashing" after twice their capacity in misses over the process's
  life, which a server meeting hundreds of shapes would reach; the check is
  turned off (`MLX_ENABLE_CACHE_THRASHING_CHECK=0`) unless the user set it.
- Pacing factor (`pacing_factor` 0, the default: a paced step may take this
  many steady decode steps, worker/scheduler.py): 3 on the CPU, 2 on CUDA
  and Metal. On this 2-core CPU (session 43, six pairs, mlxd alone, the
  smoke preset's mixed pressure) 3 took the long prompt's TTFT from 1.68-3.56x
  idle to 1.18-1.68x (mean 1.50 against 2.35, lower in every pair) and the
  streams' p99 gap under pressure from 7.7-29.4 ms to 9.4-16.7 (mean 13.0
  against 16.0): a CPU step's fixed cost of carrying any chunk is above a
  third of a decode step, so at 2 the planner paid it every 20-30 tokens. On
  CUDA 2 stands until a run measures 3 (docs/benchmarks/README.md); Metal is
  unmeasured.
- Fused step (`fused_step`: "auto", "on", "off"; worker/fused.py): decode rows
  and a prompt chunk in one forward pass. "auto" is on for a single CUDA
  worker since session 15: on the H200 with the 8B shape, mixed pressure
  through mlxd, fused on against off in three pairs (sessions 14 and 15; two
  more in session 16 agreed,
  docs/benchmarks/README.md), the streams' p99 gap was 3.05 / 3.15 / 2.52x
  their steady p99 against 4.81 / 3.98 / 4.27x, and the long prompt's TTFT
  3.00 / 3.47 / 2.17x idle against 4.48 / 6.08 / 5.76x (mixed-load
  throughput 922 against 966 tok/s on average, within the pairs' spread);
  in-process on the 0.5B shape (bench.pacing_probe, calibrated) the prompt
  took 114 ms against 164 and its longest step 38 ms against 43. Both still
  miss the targets. Off on the CPU (the tiny models changed little, and
  greedy parity is tested both ways) and on Metal (unmeasured), and for a
  worker group (fusion is unmeasured over a sharded model's collectives).
- GIL switch interval (CUDA: 0.5 ms; CPU and Metal: Python's 5 ms). The
  engine thread releases the GIL while MLX waits for the GPU, and the worker's
  IO threads (worker/proc.py) take it then; handing it back could cost the
  engine thread up to the interval. On the H200 (issue #12, C=1, qwen0.5b
  shape, docs/benchmarks/h200-qwen0.5b-serving) the worker process's decode
  step took 6.1 ms against the in-process engine's 4.9, and 5.0 with a 0.5 ms
  interval; on this CPU the interval made no difference beyond noise.
- MLX's memory limit (CUDA: the worker's memory budget; CPU and Metal: MLX's
  default). MLX's CUDA allocator keeps freed buffers for reuse until its
  process holds 95% of the device (its default memory limit, which is also
  the cache's), whatever else runs there: other hosted models' workers, a
  benchmark's other targets. The limit is soft: an allocation that would pass
  it first gives the cache back, and only a live set above it still grows. Set
  to the governor's budget, which already bounds the live set, one worker
  holds at most its budget, and its neighbours their own. On the H200 (session
  12) five processes with 8B weights on one GPU each kept freed buffers until
  cudaMallocAsync failed, and the mlxd worker died six times. A worker alone
  is unchanged: its budget (75% of the device) is far above what a step holds.
- MLX's kernel cache (CUDA): MLX compiles its CUDA kernels with NVRTC on
  first use and keeps the PTX in `MLX_PTX_CACHE_DIR`, by default
  `/tmp/mlx/<version>/ptx`. A systemd unit with `PrivateTmp=true` (ours,
  deploy/mlxd.service.in) gets an empty /tmp at every start, as does a
  reboot that clears /tmp, so every (re)start compiled them all again: on the
  H200 (session 15, llama8b) the first worker on a fresh machine took 17.7 s
  of warm-up against 2.2-2.5 s for the next ones. Unless the user set it, the
  worker keeps them in mlxd's cache directory instead (`cache_dir`,
  default `~/.cache/mlxd`), under `mlx-ptx/<MLX version>` (MLX adds no
  version to a directory it is given). On an empty cache, helper processes
  compile them beside the model's load (`kernel_warm`, worker/kernel_warm.py:
  llama8b's first warm-up on a fresh H100 2.76 s against 27.55 s, session 32).
- Decode attention (`decode_attention`: "auto", "mlx", "ragged"; CUDA only,
  worker/decode_attention.py): "ragged" runs a batched decode step's
  attention on mlxd's own kernel instead of MLX's unfused path over the
  longest row's keys; "auto" is "ragged" on CUDA since session 18. On the
  H200 (bench.decode_probe, every layer of one step, synchronised) the 0.5B
  shape's 16 rows at 512 keys took 0.70 ms against 1.75-1.97, with one row
  at 2,000 beside them 0.94 against 4.1, 64 rows 1.7 against 5.7-5.9; the
  8B shape's 1.9 / 2.6 / 7.2 against 4.0 / 11.1 / 17.0, outputs within
  bf16 rounding (at most 0.008). Through mlxd on the 0.5B shape, alternated
  twice: C=16 1,667 / 1,562 tok/s against 1,512 / 1,509, the long prompt's
  TTFT under mixed pressure 2.47 / 2.44x idle against 2.86 / 3.02x, the
  streams' gap unchanged (2.79 / 3.06x against 3.02 / 2.81x). Those are
  session 18's first kernel; session 19's, which replaced it (a block per
  KV head and its query heads), took half its time or less wherever
  several rows decode (8B: 16 rows at 2,000 keys 2.7 ms against 5.6).
- Padded passes (`pad_rows`, CUDA only; worker/fused.py): MLX's CUDA backend
  pays about 3 ms per matmul shape it has not met (a cuBLASLt algorithm
  query), so on CUDA every pass of worker/fused.py has its rows padded to a
  few dozen sizes and the warm-up runs each size's projections once; a
  prompt chunk's attention runs at padded lengths too. Measured on the H200
  (session 17, bench.pacing_probe, docs/benchmarks/README.md): a 2,000-token
  prompt's first arrival beside 16 streams took 2.7x its idle TTFT against
  4.9x unpadded (8B shape), 1.17x against 3.0x (0.5B); with the attention
  padded too (session 18, 8B shape), 1.78x against 6.3x unpadded in the same
  run. On a CPU a padded row is real work and a new
  shape costs nothing: off there and on Metal (unmeasured), and for worker
  groups (sharded projections).
- A prompt chunk's attention (`prompt_attention`; worker/prompt_attention.py,
  session 44): on the CPU and on CUDA (cuDNN's attention off, above) MLX
  has no fused kernel for a chunk's many queries under an array mask and
  builds its fallback, about 13 graph nodes a layer; the worker's own is
  five. "auto" is off everywhere until a GPU run times it (no GPU was lent
  in session 44); Metal's full attention kernel takes the mask in one node,
  so there it would stay off.
- Chunk buckets: the prefill chunk sizes a step may use (worker/scheduler.py).
  On CUDA each new pass shape has a first-use cost, so the buckets there are
  few and start at 64; the warm-up runs each once. CPU and Metal keep today's
  powers of two from 16 (Metal: unmeasured here, so its behaviour stays as it
  was).
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from worker.modelfiles.default_model import default_cache_dir

CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"
PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
# Defaults this process sets for MLX unless the environment already has them
# (module docstring); CUDA-only, ignored by the CPU and Metal backends.
MLX_ENV_DEFAULTS = {
    "MLX_CUDA_USE_CUDNN_SDPA": "0",
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
}
CUDA_GRAPH_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class BackendProfile:
    name: str
    chunk_buckets: tuple[int, ...]  # () = powers of two from min_chunk
    min_chunk: int
    fused_step: bool = False  # what fused_step "auto" means for a single worker here
    pacing_factor: float = 2.0  # what pacing_factor 0 means (worker/scheduler.py)
    switch_interval_s: float | None = None  # sys.setswitchinterval in the worker (None: Python's)
    cap_memory: bool = False  # MLX's memory limit = the worker's memory budget
    pad_rows: bool = False  # passes padded to a few row counts, warmed at start (worker/fused.py)
    ragged_decode: bool = False  # what decode_attention "auto" means (worker/decode_attention.py)
    # What decode_rows "auto" means (worker/decode_rows.py): off everywhere; on an H100
    # (sessions 36 and 38) it made every decode step 10-14% dearer (docs/architecture.md).
    decode_rows: bool = False
    # What prompt_attention "auto" means (worker/prompt_attention.py): MLX
    # has no fused kernel for a chunk's attention on the CPU or on CUDA
    # (cuDNN's off); Metal has one, which takes the mask in one node.
    prompt_attention: bool = False
    # MLX's allocator (v0.32) charges active memory in whole pages of this
    # many bytes for an array above one page (0: the bytes asked for), and
    # below a page CUDA's charges the next power of two (`allocated_bytes`).
    alloc_page: int = 0
    alloc_small_pow2: bool = False


PROFILES = {
    "cpu": BackendProfile("cpu", (), 16, pacing_factor=3.0),
    "metal": BackendProfile("metal", (), 16, alloc_page=16384),  # Apple silicon's vm_page_size
    "cuda": BackendProfile(
        "cuda",
        (64, 128, 256, 512, 1024, 2048),
        64,
        fused_step=True,
        switch_interval_s=0.0005,
        cap_memory=True,
        pad_rows=True,
        ragged_decode=True,
        alloc_page=16384,
        alloc_small_pow2=True,
    ),
}


def allocated_bytes(nbytes: int, backend: str) -> int:
    """What MLX's allocator adds to its active memory for an array of `nbytes`.

    The prefix cache's `bytes` count its arrays' contents; active memory
    counts their buffers. On the 0.5B shape a cached entry's array is a few
    hundred tokens of 256 bytes, so rounding it to a 16 KiB page adds several
    percent: session 26's H100 sweep ended with 71 more entries than it began
    with (197 against 126, at the 1 GiB cap) and active memory less the
    entries' bytes 50.3 MB higher, which the memory check read as kept memory;
    the presets that ended with fewer entries (sessions 21-24) were 9-22 MB
    lower. Measured in session 28 on the H200: 0.36 MB an entry, so about
    half of that 50.3 MB (docs/benchmarks/README.md).
    """
    prof = profile(backend)
    page = prof.alloc_page
    if page <= 0 or nbytes <= 0:
        return max(nbytes, 0)
    if nbytes >= page:
        return -(-nbytes // page) * page
    return max(8, 1 << (nbytes - 1).bit_length()) if prof.alloc_small_pow2 else nbytes


def fused_step(setting: str, backend: str, group_size: int = 1) -> bool:
    """Whether the runner fuses decode rows and a prompt chunk into one pass."""
    if setting == "auto":
        return profile(backend).fused_step and group_size == 1
    return setting == "on"


def decode_rows(setting: str, backend: str) -> bool:
    """Whether the decode batch keeps its KV in worker/decode_rows.py's layout."""
    return profile(backend).decode_rows if setting == "auto" else setting == "on"


def uses_prompt_attention(setting: str, backend: str) -> bool:
    """Whether a prompt chunk's attention runs as worker/prompt_attention.py
    computes it."""
    return profile(backend).prompt_attention if setting == "auto" else setting == "on"


def ragged_decode(setting: str, backend: str) -> bool:
    """Whether batched decode attention runs on worker/decode_attention.py's
    kernel: only on CUDA, whatever the setting (the kernel is CUDA's)."""
    if backend != "cuda":
        return False
    return profile(backend).ragged_decode if setting == "auto" else setting == "ragged"


def profile(backend: str) -> BackendProfile:
    return PROFILES.get(backend, PROFILES["cpu"])


def parse_buckets(text: str) -> tuple[int, ...]:
    """ "64,256,1024" -> (64, 256, 1024); "" -> () (the backend's default)."""
    out = tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    if any(b < 1 for b in out):
        raise ValueError("chunk buckets must be positive")
    return out


def apply_env(cuda_graphs: str = "auto", cache_dir: Path | None = None) -> None:
    """Set MLX's CUDA settings for this process before MLX is imported; a
    variable already in the environment is the user's choice and wins.
    `cache_dir`: mlxd's cache directory (None: the default), which holds
    MLX's compiled kernels (module docstring)."""
    if cuda_graphs not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}")
    for name, value in MLX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault(CUDA_GRAPHS_ENV, "1" if cuda_graphs == "on" else "0")
    if PTX_CACHE_ENV not in os.environ:
        os.environ[PTX_CACHE_ENV] = str(ptx_cache_dir(cache_dir))


def ptx_cache_dir(cache_dir: Path | None = None) -> Path:
    """Where the worker keeps MLX's compiled CUDA kernels: per MLX version,
    since MLX reads whatever PTX a directory it is given holds."""
    try:
        version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return default_cache_dir(cache_dir) / "mlx-ptx" / version
