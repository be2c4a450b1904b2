#!/bin/bash
# Session 14's CPU before/after of the governor's scratch rule (scratch per
# prompt token per pass span; passes cut to what memory holds): the smoke
# preset, all targets interleaved, before (54a626c, a worktree at $BEFORE
# sharing this checkout's .venv and models) and after (this tree),
# alternated twice on this machine. Run from the repository root.
set -x
OUT=${1:-bench/results/session14-ab}
BEFORE=${BEFORE:-/tmp/before}
for i in 1 2; do
  (cd "$BEFORE" && PYTHONPATH="$BEFORE" .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OLDPWD/$OUT/before-$i")
  .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OUT/after-$i"
done
