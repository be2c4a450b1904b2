#!/bin/bash
# Session 13's CPU A/B of idle_read (worker/fused.py): the smoke preset, all
# targets interleaved, with idle_read off (mlx-lm's order: the engine target
# through MLXD_IDLE_READ, mlxd through --mlxd-env) and on (the default),
# alternated twice on this machine. Run from the repository root.
set -x
OUT=${1:-bench/results/session13-ab}
for i in 1 2; do
  MLXD_IDLE_READ=false .venv/bin/python -m bench run --preset smoke --interleave --quiet \
    --mlxd-env MLXD_IDLE_READ=false --out "$OUT/off-$i"
  .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OUT/on-$i"
done
