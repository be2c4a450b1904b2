#!/bin/bash
# Session 17's main job (JOB_BUDGET_S: the device seconds the job may use):
# the padded passes and warm pass sizes (worker/fused.py `pad_rows`, on for
# CUDA) and the one-write join (worker/batch_padding.py), after
# job-anatomy.sh and job-shapes.sh found a paced prompt's costly steps to be
# first-use matmul shapes. First the pacing probe with padding off and on
# (pipelined, fused, 16 streams, a 2,000-token prompt arriving three times:
# with padding the first arrival should cost what the second does), then the
# 0.5B shape's standard preset, all five targets interleaved with the step
# trace, cut by a deadline; then, if time is left, the same A/B on llama8b.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
P="python3 -m bench.pacing_probe --fused on --streams 16 --prompt 2000 --long-tokens 64 --after 4 --repeat 3 --calibrated-only"
for pad in off on; do
  timeout 90 $P --shape qwen0.5b --pad-rows $pad --out "$R/pad-q-$pad.json" > "$R/pad-q-$pad.txt" 2>&1
  step pad-q-$pad $?
done
LATER=200  # llama8b's A/B after the preset: its model (55 s) and two probes
TAIL=120   # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - LATER)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave --step-trace --deadline-s $(($(left) - LATER - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
if [ "$(left)" -gt 150 ]; then
  timeout 100 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))" > "$R/model-llama8b.txt" 2>&1
  step model-llama8b $?
  for pad in off on; do
    [ "$(left)" -gt 40 ] || break
    timeout $(($(left) / 2 - 5)) $P --shape llama8b --pad-rows $pad --out "$R/pad-l-$pad.json" > "$R/pad-l-$pad.txt" 2>&1
    step pad-l-$pad $?
  done
fi
echo DONE >> "$R/steps"
