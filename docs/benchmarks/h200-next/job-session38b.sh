#!/bin/bash
# Session 38's second job, with the budget's last 300 s: one pair of MLX's
# CUDA graphs on and off through mlxd alone on the 0.5B shape (long prefill
# and mixed pressure, with the step trace): stage 1 of job-session39.sh cut
# to one pair, since a CUDA step is bound by the host's work (session 38).
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
g="python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace"
for v in on off; do
  [ "$(left)" -gt 50 ] || break
  t=$(($(left) - 5))
  [ "$v" = on ] && t=$((t / 2))  # the pair's other half keeps its time
  timeout "$t" $g --mlxd-env "MLXD_CUDA_GRAPHS=$v" --out "$R/graphs-$v" > "$R/graphs-$v.log" 2>&1
  step "graphs-$v" $?
done
echo DONE >> "$R/steps"
