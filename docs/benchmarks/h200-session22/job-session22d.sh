#!/bin/bash
# Session 22's last job (JOB_BUDGET_S about 250): `lean_decode` against the
# code before it (session22-lean.diff in reverse) on thin32 alone, five
# pairs alternated. The third job's two pairs were split by a speed that
# differed from process to process (steady steps of 8 or 12 ms): thin32
# lean 12.3 / 11.6 ms against 8.2 / 8.2, llama8b 8.65 / 12.3 against
# 9.3 / 13.2.
SHAPE=thin32
. "$(dirname "$0")/common.sh"
rm -rf "$HOME/proj-before" && mkdir -p "$HOME/proj-before"
tar cf - -C "$HOME/proj" --exclude=./bench/results . | tar xf - -C "$HOME/proj-before"
mkdir -p "$HOME/proj/bench/results" && ln -s "$HOME/proj/bench/results" "$HOME/proj-before/bench/results"
(cd "$HOME/proj-before" && patch -R -p1 < docs/benchmarks/h200-next/session22-lean.diff) > "$R/patch.log" 2>&1
step patch-before $?
probe() {  # NAME TREE
  (cd "$2" && PYTHONPATH=$HOME/site:$2 try "$1" 40 python3 -m bench.pacing_probe --shape thin32 \
    --fused on --streams 16 --prompt 1000 --calibrated-only --calibrate-s 1 --long-tokens 64 \
    --after 12 --chunk 256 --sync --out "$R/$1.json" > "$R/$1.txt" 2>&1)
}
for i in 1 2 3 4 5; do
  if [ $((i % 2)) = 1 ]; then
    probe "lean-$i" "$HOME/proj"; probe "base-$i" "$HOME/proj-before"
  else
    probe "base-$i" "$HOME/proj-before"; probe "lean-$i" "$HOME/proj"
  fi
done
echo DONE >> "$R/steps"
