#!/bin/bash
# For the GPU session after session 21 (JOB_BUDGET_S about 1,450).
# (1) The paced step's fixed-cost slack (`pacing_slack`, worker/scheduler.py)
# at 1.25 (the default) against 2.0, mlxd alone, long prefill and mixed
# pressure, alternated twice, on both shapes. Session 21: llama8b's long
# prompt went in 128-token steps in the preset (TTFT 3.98x idle) where
# `bench.pacing_probe --chunk` priced a 256-token fused step at about a
# 128-token one's cost (20-25 against 22-27 ms beside 16 streams); on the
# 0.5B shape, 512-token steps of 16-22 ms (gap 1.97x, TTFT 3.24x).
# (2) The 0.5B shape's C=16 and C=64 sweeps interleaved with the graphs-off
# ceiling: session 21's first C=64 wave through mlxd held one step of 3.09 s
# (53 decoding rows, seven prompts at a 128-token chunk), which left
# mlxd/ceiling at 0.684 +- 0.556 (its two other waves 1.03): does a fresh
# machine meet it again? If the slack wins, both shapes' presets must run
# again on it (a session each).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
slack_ab() {
  local name
  for i in 1 2; do
    for s in 1.25 2; do
      name="slack$s-$1-$i"
      try "$name" "$2" python3 -m bench run --preset standard --shape "$1" --quiet --targets mlxd \
        --scenarios long_prefill,mixed_pressure --step-trace --mlxd-env "MLXD_PACING_SLACK=$s" \
        --out "$R/$name" > "$R/$name.log" 2>&1
    done
  done
}
slack_ab llama8b 200
try model-qwen0.5b 300 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))"
slack_ab qwen0.5b 150
try c64 300 python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave \
  --step-trace --targets ceiling_alt,mlxd --scenarios sweep_c16,sweep_c64 --out "$R/c64" \
  > "$R/c64.log" 2>&1
echo DONE >> "$R/steps"
