"""Primitives of one fused decode step, with mlx-lm's cache and the rows layout.

    python docs/benchmarks/cpu-session35/count_ops.py thin32

16 greedy rows of 64-token prompts decode (a fused generator, as a CUDA
worker runs one), then a 300-token prompt joins them (its end past theirs).
For each cache (`decode_rows` off, on) it prints the primitives MLX
evaluates in one decode step before that join and one after it, counted as
`bench.pacing_probe --count-ops` counts them (`primitives_of`: the graphs
handed to `mx.eval` / `mx.async_eval`), then the kinds of the step after
the join.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.models import shape_model
from bench.pacing_probe import primitives_of
from worker import batch_padding
from worker.fused import FusedGenerator


def main(shape: str) -> None:
    batch_padding.install()
    model = load(str(shape_model(shape)))[0]
    for rows in (False, True):
        gen = FusedGenerator(
            model,
            fuse=True,
            rows=rows,
            stop_tokens=[],
            completion_batch_size=32,
            prefill_batch_size=16,
            prefill_step_size=256,
        )
        prompts = [[(7 * i + j) % 1000 + 3 for j in range(64)] for i in range(16)]
        gen.insert(prompts, max_tokens=[400] * 16)
        for _ in range(6):
            gen.next()
        one_end = primitives_of(gen.next)
        gen.insert([[(5 * j) % 1000 + 3 for j in range(300)]], max_tokens=[400])
        for _ in range(4):
            gen.next()
        joined = primitives_of(gen.next)
        name = "rows layout" if rows else "mlx-lm's cache"
        print(f"{name}: {sum(one_end.values())} a step, {sum(joined.values())} after the join")
        print(dict(sorted(joined.items())))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "thin32")
