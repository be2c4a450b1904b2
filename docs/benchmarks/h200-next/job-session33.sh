#!/bin/bash
# For the next GPU session (JOB_BUDGET_S about 1,300; an H200 if one comes):
# 1. bench.admit_probe on llama8b with every paced step forced to 256 tokens:
#    the admitting step against same-size steps without an admission
#    (session 32: the excess is in the pass, not in the bookkeeping, the KV
#    reservation or a host read-back).
# 2. The final tree's kernel helpers on the 0.5B shape, on and off, each on
#    an empty kernel cache (session 32 measured llama8b only).
# 3. `host_padding` (worker/batch_padding.py, off by default): rows leave a
#    batch with no padding read-back. mlxd alone, the C=32 sweep and mixed
#    pressure with the step trace, off and on alternated twice: the steps
#    where a row ends, and the streams' gaps.
# 4. llama8b's latency scenarios on the engine as it stands (admission_cost
#    on by default since session 32), with the step trace, against the
#    stronger ceiling: the mixed-pressure and shared-prefix records.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
try admit-llama8b 300 python3 -m bench.admit_probe --shape llama8b --chunk 256 --out "$R/admit-llama8b.json"
M=$(timeout 300 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
step model-qwen0.5b $?
cold_start qwen-warm-on qwen0.5b ~/ptx-qwen-on true 90
cold_start qwen-warm-off qwen0.5b ~/ptx-qwen-off false 120
host_padding_ab() {
  local run="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios sweep_c32,mixed_pressure --step-trace"
  for i in 1 2; do
    for mode in false true; do
      [ "$(left)" -gt 500 ] || return
      timeout 200 $run --mlxd-env MLXD_HOST_PADDING=$mode --out "$R/host-padding-$mode-$i" > "$R/host-padding-$mode-$i.log" 2>&1
      step "host-padding-$mode-$i" $?
    done
  done
}
host_padding_ab
[ "$(left)" -gt 400 ] && preset llama8b ceiling_alt,mlxd long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix latency-llama8b $(($(left) - 200))
echo DONE >> "$R/steps"
