#!/bin/bash
# Session 21's second job, on the device-seconds the first left (JOB_BUDGET_S
# about 300). In the standard preset (sessions 20 and 21) llama8b's long
# prompt beside 16 streams went in 128-token fused steps of 22-31 ms, where
# mlxd alone (session 20, grid/) ran 256-token steps of 17-20: is a 128-token
# step dearer than a 256-token one, or only cold? The pacing probe with each
# arrival's chunk forced (`--chunk`), three arrivals one after another (the
# second and third meet only shapes the first met), then the planner's own.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
probe() {
  try "pace-$1" 100 python3 -m bench.pacing_probe --shape llama8b --fused on --streams 16 \
    --prompt 2000 --calibrated-only --calibrate-s 2 --repeat 3 --long-tokens 64 --after 4 \
    ${2:+--chunk $2} --out "$R/pace-$1.json" > "$R/pace-$1.txt" 2>&1
}
probe c128 128
probe c256 256
probe planned ""
probe c512 512
echo DONE >> "$R/steps"
