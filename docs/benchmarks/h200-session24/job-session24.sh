#!/bin/bash
# For the GPU session after session 23 (JOB_BUDGET_S about 1,550). (1) The
# 0.5B shape's standard preset, interleaved with both ceilings, the engine
# and mlxd, on a fresh machine (an empty kernel cache) with a 600 s
# deadline, so the cancellation scenarios run too (session 23's 480 s cut
# them): its C=32 wave held a 2.7 s first-use compile that the warm-up now
# covers (its `c32/` run: clean), and every level should now be clean.
# (2) The peer alone at C=32 and 64 (mlxd/peer). (3) llama8b's mixed
# pressure and long prefill through mlxd alone: the default against
# `pacing_explore` on (measured paced costs, the next bucket up tried) and
# against `pacing_slack` 2.5, alternated twice: session 23's preset paced
# its long prompt in sixteen 128-token steps of 22-29 ms where the gap
# target's unit, the steady p99, was 20 ms (a paced step may cost 40), so
# the TTFT failed (5.2x) while the gap passed with room (1.5x). A pacing
# probe's first arrival explores; mixed pressure's prompt comes after the
# warm-up's calibration, which paces one prompt too.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
if [ "$(left)" -gt 1000 ]; then
  preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std 600
fi
peer qwen0.5b peer
try model-llama8b 300 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
mp="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace"
for i in 1 2; do
  try "default-$i" 100 $mp --out "$R/default-$i" > "$R/default-$i.log" 2>&1
  try "explore-$i" 100 $mp --mlxd-env MLXD_PACING_EXPLORE=true --out "$R/explore-$i" > "$R/explore-$i.log" 2>&1
  try "slack2.5-$i" 100 $mp --mlxd-env MLXD_PACING_SLACK=2.5 --out "$R/slack2.5-$i" > "$R/slack2.5-$i.log" 2>&1
done
echo DONE >> "$R/steps"
