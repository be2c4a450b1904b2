#!/bin/bash
# Session 16's CPU before/after: the smoke preset, all targets interleaved,
# before (ee83ad4, session 15's end: a worktree at $BEFORE sharing this
# checkout's .venv) and after (this tree), alternated. Run from the
# repository root.
set -x
OUT=${1:-bench/results/session16-ab}
BEFORE=${BEFORE:-/tmp/before}
for i in 1 2; do
  (cd "$BEFORE" && PYTHONPATH="$BEFORE" .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OLDPWD/$OUT/before-$i")
  .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OUT/after-$i"
done
