#!/bin/bash
# Session 33's GPU job (JOB_BUDGET_S up to 1,300; an H200 if one comes). 1 and 2
# alternate, a pair of each at a time:
# 1. `host_padding` (worker/batch_padding.py, off by default): rows leave a
#    batch with no padding read-back. mlxd alone on llama8b, the C=32 sweep,
#    the idle long prompt (what the mixed-pressure TTFT is divided by),
#    mixed pressure and the shared prefix with the step trace, off and on
#    alternated twice: the steps where a row ends, the streams' gaps and the
#    warm turn's TTFT.
# 2. `pipelined_calibration` (worker/calibrate.py, off by default): the
#    warm-up's paced steps pipelined as live ones are, so the cost model stops
#    pricing a chunk beside streams at a timed step's cost. mlxd alone on
#    llama8b, the idle long prompt and mixed pressure with the step trace,
#    off and on alternated twice: the chunks the planner takes, the long
#    prompt's TTFT and the streams' gaps.
# 3. bench.admit_probe on llama8b with every paced step forced to 256 tokens:
#    the admitting step against same-size steps without an admission.
# 4. The 0.5B standard preset whole on the engine as it stands
#    (admission_cost on by default since session 32; no GPU sweep has run
#    with it yet), every ceiling, the engine and mlxd interleaved.
# 5. The kernel helpers on the 0.5B shape, on and off, each on an empty
#    kernel cache (session 32 measured llama8b only), if time is left.
# 6. llama8b's latency scenarios against the stronger ceiling, if time is left.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
# One pair of each setting, then the second pairs, so that a short machine
# still gives one of each: ab NAME VAR SCENARIOS SECONDS REP.
ab() {
  local run="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios $3 --step-trace"
  for mode in false true; do
    [ "$(left)" -gt "$4" ] || return
    timeout "$4" $run --mlxd-env "$2=$mode" --out "$R/$1-$mode-$5" > "$R/$1-$mode-$5.log" 2>&1
    step "$1-$mode-$5" $?
  done
}
for i in 1 2; do
  ab host-padding MLXD_HOST_PADDING sweep_c32,long_prefill,mixed_pressure,shared_prefix 200 $i
  ab calibration MLXD_PIPELINED_CALIBRATION long_prefill,mixed_pressure 150 $i
done
try admit-llama8b 200 python3 -m bench.admit_probe --shape llama8b --chunk 256 --out "$R/admit-llama8b.json"
M=$(timeout 300 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
step model-qwen0.5b $?
[ "$(left)" -gt 400 ] && preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std-qwen0.5b $(($(left) - 420 > 200 ? $(left) - 420 : $(left) - 200))
cold_start qwen-warm-on qwen0.5b ~/ptx-qwen-on true 90
cold_start qwen-warm-off qwen0.5b ~/ptx-qwen-off false 120
[ "$(left)" -gt 250 ] && preset llama8b ceiling_alt,mlxd long_prefill,mixed_pressure,shared_prefix latency-llama8b $(($(left) - 200))
echo DONE >> "$R/steps"
