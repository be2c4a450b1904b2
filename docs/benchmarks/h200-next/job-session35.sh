#!/bin/bash
# For the next GPU session (JOB_BUDGET_S about 1,300; an H200 if one comes),
# on the engine as it stands (admission_cost on since session 32,
# host_padding on since session 33). Session 34's H100 measured llama8b's
# latency scenarios, the warm turn's stages and the admit probe
# (../h100-session34/). First the step a long prompt joins in, split:
# bench.admit_probe's `phases` pass now evaluates the join in its own stage
# (`_join`, in the last chunk's step), so the joining step holds its decode
# pass alone; against the default pass that says whether the join or the
# pass over the joined rows costs the 20 ms. Then what is left of session
# 34's plan:
# 1. The 0.5B standard preset whole, every ceiling, the engine and mlxd
#    interleaved: no GPU sweep has run with either setting on. Its deadline
#    takes what the budget leaves after the rest's minimum.
# 2. The kernel helpers on the 0.5B shape, on and off, each on an empty
#    kernel cache (session 32 measured llama8b only).
# 3. llama8b's latency scenarios against the stronger ceiling.
# A change to the step a long prompt joins in (session 34: 43-44 ms on the
# H100, the streams' p99 gap under mixed pressure in both runs) comes first
# if one is built: mlxd alone, `--scenarios long_prefill,mixed_pressure`,
# its setting off and on, alternated.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
try admit-llama8b 150 python3 -m bench.admit_probe --shape llama8b --chunk 256 --prompts 256,2000 --reps 4 --out "$R/admit-llama8b.json"
M=$(timeout 600 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
step model-qwen0.5b $?
D=$(($(left) - 350)); [ "$D" -gt 600 ] && D=600; [ "$D" -lt 200 ] && D=200
preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std-qwen0.5b $D
cold_start qwen-warm-on qwen0.5b ~/ptx-qwen-on true 90
cold_start qwen-warm-off qwen0.5b ~/ptx-qwen-off false 120
if [ "$(left)" -gt 250 ]; then
  preset llama8b ceiling_alt,mlxd long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix latency-llama8b $(($(left) - 150))
fi
echo DONE >> "$R/steps"
