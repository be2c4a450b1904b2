"""Primitives of the steps around a long prompt's join, with mlx-lm's cache.

    python docs/benchmarks/session36/count_join.py thin32

16 greedy rows of 64-token prompts decode (a fused generator, as a CUDA
worker runs one), then a 300-token prompt joins them in 256-token chunks.
For the six steps after it arrives, prints the primitives MLX evaluates in
each (counted as `bench.pacing_probe --count-ops` counts them) and the
decode rows after it, twice: as served (the join stays lazy until the next
step's pass reads it) and with the joined caches evaluated right after the
step that joins them (as `bench.admit_probe`'s `phases` pass does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.models import shape_model
from bench.pacing_probe import primitives_of
from worker import batch_padding
from worker.fused import FusedGenerator


def steps(model: object, join_apart: bool) -> list[tuple[int, int]]:
    gen = FusedGenerator(
        model,
        fuse=True,
        rows=False,
        stop_tokens=[],
        completion_batch_size=32,
        prefill_batch_size=16,
        prefill_step_size=256,
    )
    gen.insert(
        [[(7 * i + j) % 1000 + 3 for j in range(64)] for i in range(16)], max_tokens=[400] * 16
    )
    for _ in range(6):
        gen.next()
    out = [(sum(primitives_of(gen.next).values()), len(gen._generation_batch))]
    gen.insert([[(5 * j) % 1000 + 3 for j in range(300)]], max_tokens=[400])
    for _ in range(6):
        counted = sum(primitives_of(gen.next).values())
        joined = len(gen._generation_batch) == 17
        if join_apart and joined and out[-1][1] == 16:
            mx.eval([c.state for c in gen._generation_batch.prompt_cache])
        out.append((counted, len(gen._generation_batch)))
    return out


def main(shape: str) -> None:
    batch_padding.install()
    model = load(str(shape_model(shape)))[0]
    for apart in (False, True):
        name = "join evaluated apart" if apart else "as served"
        print(f"{name}: (primitives, decode rows after) a step, the first before the prompt")
        print(f"  {steps(model, apart)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "thin32")
