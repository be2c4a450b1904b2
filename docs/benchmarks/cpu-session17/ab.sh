#!/bin/bash
# Session 17's CPU before/after: the smoke preset, all targets interleaved,
# before (4dd1455, session 16's end: a worktree at $BEFORE sharing this
# checkout's .venv) and after (this tree), alternated. Run from the
# repository root.
set -x
OUT=${1:-bench/results/session17-ab}
BEFORE=${BEFORE:-/tmp/before}
for i in 1 2; do
  (cd "$BEFORE" && PYTHONPATH="$BEFORE" .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OLDPWD/$OUT/before-$i")
  .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OUT/after-$i"
done
