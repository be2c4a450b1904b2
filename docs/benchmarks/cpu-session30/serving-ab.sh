#!/bin/bash
# Session 30's serving-path A/B on this CPU: HEAD with one file taken from
# another commit (before) against HEAD (after), mlxd alone, the standard
# preset's C=8 and C=16 levels and its sustained decode on the tiny shape,
# alternated three times; the report's "CPU per output token" table gives
# the gateway's and the worker's CPU per streamed token. From the root:
#     FILE=gateway/http/slow_reader.py FROM=3bbad5e bash docs/benchmarks/cpu-session30/serving-ab.sh [OUT]
set -ex
OUT=${1:-bench/results/serving-ab}
DIR=/tmp/mlxd-before
git worktree remove --force "$DIR" 2>/dev/null || true
git worktree add -f "$DIR" HEAD
git show "${FROM:?the commit to take FILE from}:${FILE:?a path}" > "$DIR/$FILE"
ln -s "$PWD/.venv" "$DIR/.venv"
run="python -m bench run --preset standard --shape tiny --quiet --targets mlxd --scenarios sweep_c8,sweep_c16,sustained_decode"
for i in 1 2 3; do
  (cd "$DIR" && PYTHONPATH="$DIR" .venv/bin/$run --out "$OLDPWD/$OUT/before-$i")
  .venv/bin/$run --out "$OUT/after-$i"
done
git worktree remove --force "$DIR"
