#!/bin/bash
# For the GPU session after session 29 (JOB_BUDGET_S about 1,300-1,600):
# llama8b first. Session 29's H100 ran the 0.5B preset on the final engine
# whole (`../h100-session29/std/`), but its llama8b targets rejected every
# request: the governor's scratch set-aside (9.1 GiB) outgrew the 8.9 GiB
# beside the weights in a third of the H100. With the set-aside halved to fit (session 29's
# governor change) three 8B targets fit an H100 as well as an H200.
# (1) llama8b with the graphs-off ceiling, the engine and mlxd, every
# scenario but the sustained and slow-reader ones, cut by what time is
# left after the peers; (2) the peer alone at C=32 and 64 on llama8b and on
# the 0.5B shape (mlxd/peer on each, same machine); (3) if time is left,
# the 0.5B preset again (the H200's, where session 29's was an H100's).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
if [ "$(left)" -gt 500 ]; then
  preset llama8b ceiling_alt,engine,mlxd sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix std-llama8b $(($(left) - 420))
fi
peer llama8b peer-llama8b
try model-qwen0.5b 120 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))"
if [ "$(left)" -gt 200 ]; then
  timeout $(($(left) - 60)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets peer --scenarios sweep_c32,sweep_c64 --out "$R/peer-qwen0.5b" > "$R/peer-qwen0.5b.log" 2>&1
  step peer-qwen0.5b $?
fi
if [ "$(left)" -gt 650 ]; then
  preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std $(($(left) - 200))
fi
echo DONE >> "$R/steps"
