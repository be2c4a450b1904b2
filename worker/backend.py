"""What differs per MLX backend (CPU, Metal, CUDA), in one place.

No MLX import at module level: `apply_env` must run before MLX is first
imported (MLX reads its CUDA settings from the environment once).

- CUDA graphs (`cuda_graphs`: "auto", "on", "off"): "auto" turns them off on
  CUDA. Measured on the H200 (issue #12, /work/shared/gpu.md): with graphs on,
  every prefill pass of a new shape, which is every paced step, cost 60-90 ms
  against a 7-8 ms decode step, and batched decode at 16-64 rows was 20-35%
  slower; off, a warm 1,023-token paced pass cost 16 ms. Off costs about 7% of
  decode rate at batch 1 on the 0.5B shape. A variable the user already set
  wins. CPU and Metal ignore the variable.
- Chunk buckets: the prefill chunk sizes a step may use (worker/scheduler.py).
  On CUDA each new pass shape compiles kernels on first use (60-75 ms), so the
  buckets there are few and start at 64; the warm-up runs each once. CPU and
  Metal keep today's powers of two from 16 (Metal: unmeasured here, so its
  behaviour stays as it was).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"
CUDA_GRAPH_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class BackendProfile:
    name: str
    chunk_buckets: tuple[int, ...]  # () = powers of two from min_chunk
    min_chunk: int


PROFILES = {
    "cpu": BackendProfile("cpu", (), 16),
    "metal": BackendProfile("metal", (), 16),
    "cuda": BackendProfile("cuda", (64, 128, 256, 512, 1024, 2048), 64),
}


def profile(backend: str) -> BackendProfile:
    return PROFILES.get(backend, PROFILES["cpu"])


def parse_buckets(text: str) -> tuple[int, ...]:
    """ "64,256,1024" -> (64, 256, 1024); "" -> () (the backend's default)."""
    out = tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    if any(b < 1 for b in out):
        raise ValueError("chunk buckets must be positive")
    return out


def apply_env(cuda_graphs: str = "auto") -> None:
    """Set MLX's CUDA graph mode for this process before MLX is imported."""
    if cuda_graphs not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}")
    if CUDA_GRAPHS_ENV in os.environ:
        return  # the user's explicit choice
    os.environ[CUDA_GRAPHS_ENV] = "1" if cuda_graphs == "on" else "0"
