#!/bin/bash
# The CPU before/after of an engine change (session 17 on; sessions 14-16
# kept their own copies beside their records): the smoke preset, all targets
# interleaved, before (commit $BEFORE in a worktree at /tmp/mlxd-before that
# shares this checkout's .venv) and after (this tree), alternated $RUNS times.
# Run from the repository root:
#     BEFORE=<commit> bash docs/benchmarks/cpu-ab.sh [OUT]
set -ex
OUT=${1:-bench/results/ab}
RUNS=${RUNS:-2}
DIR=/tmp/mlxd-before
git worktree remove --force "$DIR" 2>/dev/null || true
git worktree add -f "$DIR" "${BEFORE:?set BEFORE to the commit to compare with}"
ln -s "$PWD/.venv" "$DIR/.venv"
for i in $(seq "$RUNS"); do
  (cd "$DIR" && PYTHONPATH="$DIR" .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OLDPWD/$OUT/before-$i")
  .venv/bin/python -m bench run --preset smoke --interleave --quiet --out "$OUT/after-$i"
done
git worktree remove --force "$DIR"
