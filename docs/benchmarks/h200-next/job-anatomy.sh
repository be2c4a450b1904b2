#!/bin/bash
# Session 17 (JOB_BUDGET_S: the device seconds the job may use): where a
# paced prompt's first step, its finishing step and the decode step after it
# go (session 16's step traces on llama8b: 1.5-1.8x a middle step, 20-55 ms
# over the prediction, and 30-42 ms against 14-19). The pacing probe in
# process, fused on, 16 streams and a 2,000-token prompt that decodes on
# after its first token, three arrivals one after another (the second and
# third meet only shapes the first met): once with every step synchronised
# (each step's own cost, host part apart) and the cProfiles of those steps,
# once pipelined as the worker runs. The 0.5B shape first, then llama8b,
# then the prefix probe's warm turns on llama8b with their cProfile.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
P="python3 -m bench.pacing_probe --fused on --streams 16 --prompt 2000 --long-tokens 64 --after 4 --repeat 3 --calibrated-only"
timeout 150 $P --shape qwen0.5b --sync --profile --out "$R/anat-q-sync.json" > "$R/anat-q-sync.txt" 2>&1
step anat-q-sync $?
timeout 120 $P --shape qwen0.5b --out "$R/anat-q-pipe.json" > "$R/anat-q-pipe.txt" 2>&1
step anat-q-pipe $?
timeout 120 $P --shape qwen0.5b --fused off --out "$R/anat-q-pipe-off.json" > "$R/anat-q-pipe-off.txt" 2>&1
step anat-q-pipe-off $?
if [ "$(left)" -gt 330 ]; then
  timeout 150 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))" > "$R/model-llama8b.txt" 2>&1
  step model-llama8b $?
  timeout $(($(left) / 2 - 10)) $P --shape llama8b --sync --profile --out "$R/anat-l-sync.json" > "$R/anat-l-sync.txt" 2>&1
  step anat-l-sync $?
  timeout $(($(left) - 15)) $P --shape llama8b --out "$R/anat-l-pipe.json" > "$R/anat-l-pipe.txt" 2>&1
  step anat-l-pipe $?
fi
# A warm shared-prefix turn on llama8b (session 16: 33 ms against a cold 93;
# 5x needs about 19): where it goes, in cProfile.
if [ "$(left)" -gt 60 ]; then
  timeout $(($(left) - 10)) python3 -m bench.prefix_probe --shape llama8b --conversations 2 --profile --out "$R/prefix-l.json" > "$R/prefix-l.txt" 2>&1
  step prefix-l $?
fi
echo DONE >> "$R/steps"
