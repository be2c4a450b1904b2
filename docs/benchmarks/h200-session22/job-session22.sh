#!/bin/bash
# For session 22's GPU time (JOB_BUDGET_S about 1,400).
# (1) What a step costs in kernel launches and host work alone: the pacing
# probe on `thin32` (llama8b's 32 layers at a width whose matmuls cost next
# to nothing), 16 streams and a 2,000-token prompt at a forced 256-token
# chunk, with the primitives of each step counted on CUDA (`--count-ops`);
# on the code before and after the chunk's padded mask and the attention
# filler were built once a pass instead of once a layer (session22-fused.diff,
# applied in reverse to a copy of the tree). Then llama8b the same way, and
# the planner's own chunk on the new code.
# (2) The paced step's fixed-cost slack (`pacing_slack`) at 1.25 (the
# default) against 2.0 through mlxd alone, long prefill and mixed pressure,
# alternated, on llama8b (session 21: its long prompt went in 128-token
# steps, TTFT 3.98x idle, where a 256-token fused step cost about a 128-token
# one's: 20-25 against 22-27 ms beside 16 streams).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
# The copy shares the models (bench/results/models: llama8b's is 16 GB).
rm -rf "$HOME/proj-before" && mkdir -p "$HOME/proj-before"
tar cf - -C "$HOME/proj" --exclude=./bench/results . | tar xf - -C "$HOME/proj-before"
mkdir -p "$HOME/proj/bench/results" && ln -s "$HOME/proj/bench/results" "$HOME/proj-before/bench/results"
(cd "$HOME/proj-before" && patch -R -p1 < docs/benchmarks/h200-next/session22-fused.diff) > "$R/patch.log" 2>&1
step patch-before $?
probe() {  # NAME TREE SHAPE SECONDS [CHUNK]
  (cd "$2" && PYTHONPATH=$HOME/site:$2 try "$1" "$4" python3 -m bench.pacing_probe --shape "$3" \
    --fused on --streams 16 --prompt 2000 --calibrated-only --calibrate-s 2 --repeat 3 \
    --long-tokens 64 --after 4 --count-ops ${5:+--chunk $5} --out "$R/$1.json" > "$R/$1.txt" 2>&1)
}
try model-thin32 120 python3 -c "from bench.models import shape_model; print(shape_model('thin32'))"
probe thin-after "$HOME/proj" thin32 120 256
probe thin-before "$HOME/proj-before" thin32 120 256
probe thin-after-c512 "$HOME/proj" thin32 120 512
probe l8-after "$HOME/proj" llama8b 150 256
probe l8-before "$HOME/proj-before" llama8b 150 256
probe l8-planned "$HOME/proj" llama8b 150
slack() {
  local name="slack$1-$2"
  try "$name" 200 python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd \
    --scenarios long_prefill,mixed_pressure --step-trace --mlxd-env "MLXD_PACING_SLACK=$1" \
    --out "$R/$name" > "$R/$name.log" 2>&1
}
slack 1.25 1
slack 2 1
slack 1.25 2
slack 2 2
echo DONE >> "$R/steps"
