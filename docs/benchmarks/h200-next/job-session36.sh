#!/bin/bash
# For the next GPU session (JOB_BUDGET_S about 1,300; an H200 if one comes).
# Session 35 had no device time; it built `decode_rows` (worker/decode_rows.py:
# the decode batch's KV with room ahead, rows joining without the others being
# copied), off by default on CUDA until this job measures it. First the
# joining step, in process: bench.admit_probe on llama8b with the layout off
# and on (the summary's `joining` against `after`; session 34's H100: 27.4-28.0
# ms against 6.4-7.0 after a 2,000-token prompt). Then mixed pressure through
# mlxd alone, off and on, alternated (session 34: the streams' p99 gap 3.73x
# and 2.09x, the long prompt's TTFT 2.33-2.37x idle). Then what is left of
# session 34's plan: the 0.5B standard preset whole, the kernel helpers on the
# 0.5B shape, llama8b's latency scenarios against the stronger ceiling.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
for v in off on; do
  try admit-llama8b-rows-$v 150 python3 -m bench.admit_probe --shape llama8b --chunk 256 --prompts 256,2000 --reps 4 --decode-rows $v --out "$R/admit-llama8b-rows-$v.json"
done
setting_ab MLXD_DECODE_ROWS rows llama8b 200
# The rest only with time for it: a step cut at the lease's end leaves nothing.
if [ "$(left)" -gt 600 ]; then
  M=$(timeout 600 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
  step model-qwen0.5b $?
  D=$(($(left) - 350)); [ "$D" -gt 600 ] && D=600; [ "$D" -lt 200 ] && D=200
  preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std-qwen0.5b $D
fi
cold_start qwen-warm-on qwen0.5b ~/ptx-qwen-on true 90
if [ "$(left)" -gt 250 ]; then
  preset llama8b ceiling_alt,mlxd long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix latency-llama8b $(($(left) - 150))
fi
echo DONE >> "$R/steps"
