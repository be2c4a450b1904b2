"""The peer: `mlx_lm.server` on the same model, driven by the same client.

Owns how mlx_lm.server is started and addressed, from what its installed
server.py (mlx-lm 0.32.2) does:
- started as `python -m mlx_lm server --model DIR` on a free loopback port, with
  `--decode-concurrency` set to the workload's largest concurrency (its default,
  32, would cap the C=64 level) and its other defaults: prompt concurrency 8,
  prefill step 2048, greedy (`--temp 0`);
- the request's "model" field is looked up in its model map, where the
  `--model` path maps to itself, so requests carry the model directory path;
- it accepts `logit_bias` (token id -> bias), `stream_options.include_usage`
  (exact completion_tokens and prompt_tokens_details.cached_tokens), but has no
  token ids in its chunks: each content chunk counts as one token event;
- /health answers before the model is loaded (it loads in the generation
  thread), so readiness is /health plus one warm-up request.
It has no stats endpoint: cancellation-to-retirement and memory terms are
reported for mlxd only; process RSS is recorded for both.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.servers import LOOPBACK, ServerProcess, free_port, spawn, stop, wait_ready


def start_peer(
    model_dir: Path,
    work_dir: Path,
    *,
    max_batch: int,
    prefill_batch: int = 8,
    prefill_chunk: int = 2048,
    timeout_s: float = 900.0,
    env_extra: dict[str, str] | None = None,
    memory_limit_bytes: int | None = None,
) -> ServerProcess:
    """`memory_limit_bytes`: MLX's memory limit in the server (bench/mlx_capped.py),
    for a GPU it shares with the run's other targets; None keeps MLX's default."""
    port = free_port()
    capped = ["bench.mlx_capped", str(memory_limit_bytes)] if memory_limit_bytes else []
    argv = [
        sys.executable,
        "-m",
        *capped,
        "mlx_lm",
        "server",
        "--model",
        str(model_dir),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--temp",
        "0.0",
        "--decode-concurrency",
        str(max_batch),
        "--prompt-concurrency",
        str(prefill_batch),
        "--prefill-step-size",
        str(prefill_chunk),
        "--log-level",
        "WARNING",
    ]
    env = dict(env_extra or {})
    log = work_dir / "peer.log"
    start = time.monotonic()
    server = ServerProcess(
        "peer",
        f"http://{LOOPBACK}:{port}",
        str(model_dir),
        spawn("peer", argv, env, log),
        log,
        argv,
        env,
    )
    try:
        wait_ready(server, "/health", timeout_s)
    except BaseException:
        stop(server)
        raise
    server.startup_s = time.monotonic() - start
    return server
