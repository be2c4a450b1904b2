#!/bin/bash
# Session 22's third job (JOB_BUDGET_S about 800). (1) `lean_decode`
# (worker/fused.py): decode passes through fused_hidden with two-dimensional
# activations (no flatten/unflatten around each projection's matmul), before
# and after (session22-lean.diff applied in reverse to a copy of the tree),
# the pacing probe synchronised, thin32 and llama8b, alternated twice.
# (2) The 0.5B shape's C=64 sweep twice on one machine: its first wave
# through mlxd held a step of 2.7-3.1 s in sessions 21 and 22 on fresh
# machines; if the second run on the same machine (MLX's kernel cache now
# filled) has none, it is a kernel compiled on first use.
SHAPE=thin32
. "$(dirname "$0")/common.sh"
rm -rf "$HOME/proj-before" && mkdir -p "$HOME/proj-before"
tar cf - -C "$HOME/proj" --exclude=./bench/results . | tar xf - -C "$HOME/proj-before"
mkdir -p "$HOME/proj/bench/results" && ln -s "$HOME/proj/bench/results" "$HOME/proj-before/bench/results"
(cd "$HOME/proj-before" && patch -R -p1 < docs/benchmarks/h200-next/session22-lean.diff) > "$R/patch.log" 2>&1
step patch-before $?
probe() {  # NAME TREE SHAPE SECONDS
  (cd "$2" && PYTHONPATH=$HOME/site:$2 try "$1" "$4" python3 -m bench.pacing_probe --shape "$3" \
    --fused on --streams 16 --prompt 2000 --calibrated-only --calibrate-s 2 --repeat 2 \
    --long-tokens 64 --after 6 --chunk 256 --sync --count-ops --out "$R/$1.json" > "$R/$1.txt" 2>&1)
}
for i in 1 2; do
  probe "thin-lean-$i" "$HOME/proj" thin32 100
  probe "thin-base-$i" "$HOME/proj-before" thin32 100
done
try model-llama8b 400 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
for i in 1 2; do
  probe "l8-lean-$i" "$HOME/proj" llama8b 120
  probe "l8-base-$i" "$HOME/proj-before" llama8b 120
done
try model-qwen0.5b 300 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))"
for i in 1 2; do
  try "c64-$i" 200 python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave \
    --step-trace --targets ceiling_alt,mlxd --scenarios sweep_c64 --out "$R/c64-$i" \
    > "$R/c64-$i.log" 2>&1
done
ls -la ~/.cache/mlxd/mlx-ptx/*/ > "$R/ptx-cache.txt" 2>&1
echo DONE >> "$R/steps"
