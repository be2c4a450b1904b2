"""The worker's launch contract: its frozen configuration, command line and environment.

No MLX import here: the gateway's supervisor builds a worker command line from
`WorkerConfig.to_argv()`, and the worker parses it back with `from_argv()`, so
both sides share one definition of the flags.

The handshake token is not a flag (flags are visible in `ps`): it travels in the
environment variable named by `TOKEN_ENV`. `DEFAULT_MODEL_NAME` is the model id a
worker launched with model "default" serves, and `openblas_preload_path()` the library
the launcher preloads on Linux (docs/configuration.md). Stdlib only, no I/O at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import sys
from dataclasses import dataclass

from protocol.frames import DEFAULT_MAX_FRAME_BYTES

TOKEN_ENV = "MLXD_WORKER_TOKEN"
FAULTS_ENV = "MLXD_TEST_FAULTS"  # "1" enables test-only fault hooks (wedge, crash)
# Test-only (FAULTS_ENV): while the file this names exists, a worker's model load
# fails as CUDA's out-of-memory error does, and deletes the file (one failure).
LOAD_NO_MEMORY_ENV = "MLXD_TEST_LOAD_NO_MEMORY"
# Test-only (FAULTS_ENV): an Add with this sampling seed kills the worker that
# receives it, every time: a poison request (tests/test_isolation.py).
CRASH_SEED = 0x0DEAD_C0DE
# The embedded default model (worker/modelfiles/default_model.py converts it).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    socket: str
    model: str  # a model directory, or "default" for the embedded default model
    model_id: str = ""
    epoch: int = 0
    cache_dir: str = ""
    max_batch: int = 32
    prefill_batch: int = 8
    prefill_chunk: int = 2048
    pacing: bool = True
    # A paced step (prefill beside decoding streams) may take this many steady
    # decode steps (worker/scheduler.py); 0: the backend's (worker/backend.py).
    pacing_factor: float = 0.0
    # When the smallest chunk's predicted cost is above a paced step's budget
    # (a pass's fixed cost is paid anyway), the step may carry a chunk
    # predicted to cost up to this multiple of the smallest's (worker/scheduler.py).
    pacing_slack: float = 1.25
    # A paced step that admits requests is priced with what admitting one has
    # cost beyond its pass, learned from live steps (worker/scheduler.py).
    admission_cost: bool = True
    # Rows leave a batch reading their padding from the host's copy, not the
    # device (worker/batch_padding.py).
    host_padding: bool = True
    # On CUDA, compile MLX's kernels in helper processes beside the model's load
    # when the kernel cache lacks them (worker/kernel_warm.py).
    kernel_warm: bool = True
    # Warm-up spends about this many seconds calibrating the prefill cost model
    # and warming the chunk buckets (worker/calibrate.py); 0: skip.
    pacing_calibration_s: float = 2.0
    # Backend choices (worker/backend.py): CUDA graphs "auto" | "on" | "off", and
    # the prefill chunk sizes as "64,256,1024" ("": the backend's default).
    cuda_graphs: str = "auto"
    chunk_buckets: str = ""
    # One forward pass for decode rows and a prompt chunk (worker/fused.py):
    # "auto" (the backend's choice, worker/backend.py) | "on" | "off".
    fused_step: str = "auto"
    # Batched decode attention (worker/decode_attention.py): "auto" (the
    # backend's choice, worker/backend.py) | "mlx" (mlx-lm's) | "ragged" (CUDA).
    decode_attention: str = "auto"
    # With ragged decode attention, the decode rows' heads made and q and k
    # rotated on one CUDA kernel (worker/decode_rotary.py). Off: on an H100
    # (session 42) it made the 0.5B shape's decode step 4% slower and the 8B
    # shape's no faster.
    decode_rotary: bool = False
    # The decode batch's KV with room ahead, rows joining and leaving without
    # the others being copied (worker/decode_rows.py): "auto" (the backend's
    # choice, worker/backend.py) | "on" | "off". Needs a fusable model.
    decode_rows: str = "auto"
    # With nothing else decoding, a step that finishes prompts reads their first
    # tokens before building the next pass (worker/fused.py, `idle_read`).
    idle_read: bool = True
    # Prompts that finish in a fused step: their first tokens read in that step
    # (worker/fused.py, `join_read`): on an H100 (session 42) the long
    # prompt's first token one step sooner, 22 ms on the 8B shape.
    join_read: bool = True
    # A prompt chunk's attention in five graph nodes instead of MLX's
    # fallback's thirteen or so (worker/prompt_attention.py): "auto" (the
    # backend's choice, worker/backend.py) | "on" | "off".
    prompt_attention: str = "auto"
    # An idle worker that receives a request waits until no other has arrived
    # for this long (at most 4 times it) before its first step, so a wave the
    # gateway submitted together is admitted together (worker/proc.py); 0: off.
    arrival_quiet_s: float = 0.001
    memory_budget_bytes: int = 0  # 0: a safe share of the machine (worker/governor.py)
    kv_budget_bytes: int = 0  # optional cap on all KV state; 0: what the budget leaves
    prefix_cache_bytes: int = 1 << 30  # 0 disables the prefix cache
    # A sharded worker group (worker/group.py): ranks come from MLX's own
    # environment (MLX_RANK, MLX_HOSTFILE for ring; NCCL's on CUDA).
    group_size: int = 1
    group_backend: str = "ring"
    # Grammar compilation (worker/constraints.py): off the engine thread on this
    # many threads; a compile over the time limit or a grammar over the size
    # limit fails its request with a 400.
    grammar_compile_threads: int = 1
    grammar_compile_timeout_s: float = 10.0
    grammar_max_bytes: int = 4 << 20
    # A directory for the step trace (worker/step_trace.py): one JSON line per
    # engine step, for diagnosis; "": off.
    step_trace: str = ""
    heartbeat_s: float = 0.5
    accept_timeout_s: float = 60.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # the gateway's client assumes it

    def to_argv(self) -> list[str]:
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def from_argv(cls, argv: list[str]) -> WorkerConfig:
        """Parse flags; raises SystemExit(2) on bad input, as argparse does."""
        parser = argparse.ArgumentParser(prog="mlxd worker")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if default is dataclasses.MISSING:
                parser.add_argument(flag, dest=f.name, required=True, type=str)
            elif isinstance(default, bool):
                parser.add_argument(
                    flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default
                )
            else:
                parser.add_argument(flag, dest=f.name, type=type(default), default=default)
        ns = parser.parse_args(argv)
        cfg = cls(**vars(ns))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.max_batch < 1 or self.prefill_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("max_batch, prefill_batch and prefill_chunk must be positive")
        if min(self.memory_budget_bytes, self.kv_budget_bytes, self.prefix_cache_bytes) < 0:
            raise ValueError("memory and cache sizes must not be negative")
        if self.group_size < 1:
            raise ValueError("group_size must be at least 1")
        if self.pacing_calibration_s < 0:
            raise ValueError("pacing_calibration_s must not be negative")
        if self.grammar_compile_threads < 1 or self.grammar_compile_timeout_s <= 0:
            raise ValueError(
                "grammar_compile_threads and grammar_compile_timeout_s must be positive"
            )
        if self.grammar_max_bytes < 1:
            raise ValueError("grammar_max_bytes must be positive")
        if not (self.pacing_factor == 0 or 1.0 < self.pacing_factor <= 100.0):  # NaN too
            raise ValueError("pacing_factor must be 0 (the backend's) or above 1, at most 100")
        if self.pacing_slack < 1.0:
            raise ValueError("pacing_slack must be at least 1")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError("cuda_graphs must be auto, on or off")
        if self.fused_step not in ("auto", "on", "off"):
            raise ValueError("fused_step must be auto, on or off")
        if self.decode_rows not in ("auto", "on", "off"):
            raise ValueError("decode_rows must be auto, on or off")
        if self.prompt_attention not in ("auto", "on", "off"):
            raise ValueError("prompt_attention must be auto, on or off")
        if self.decode_attention not in ("auto", "mlx", "ragged"):
            raise ValueError("decode_attention must be auto, mlx or ragged")
        try:
            buckets = [int(x) for x in self.chunk_buckets.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError("chunk_buckets must be a comma-separated list of sizes") from None
        if any(b < 1 for b in buckets):
            raise ValueError("chunk_buckets must be positive")
        if not 0 <= self.arrival_quiet_s <= 0.05:
            raise ValueError("arrival_quiet_s must be within 0-0.05")
        if self.heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be positive")


# The worker knobs' defaults, the one source of truth for them: the gateway's
# Settings (gateway/config.py) and the worker's own components (worker/scheduler.py,
# worker/runner.py) read theirs from here.
DEFAULTS = WorkerConfig(socket="", model="default")


def openblas_preload_path() -> str | None:
    """Debian's pthread OpenBLAS (package libopenblas0-pthread), to LD_PRELOAD, if present."""
    if not sys.platform.startswith("linux"):
        return None
    found = sorted(glob.glob("/usr/lib/*/openblas-pthread/libopenblas.so.0"))
    return found[0] if found else None
