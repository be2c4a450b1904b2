#!/bin/bash
# For the GPU session after session 20 (JOB_BUDGET_S: the device seconds the
# job may use; about 1,500 after a machine's start and install). Both
# shapes' standard presets on the engine as it now stands, for issue #12's
# "Must show": (1) the 0.5B shape's (session 17 ran it last; since then the
# planner's reach, the grouped decode attention kernel, the prompt tokens'
# reuse, the KV buffers' grid growth, the frozen heaps), interleaved with both ceilings (the
# graphs-on one was the faster at C=1 there), the engine and mlxd, cut by a
# 600 s deadline (session 20: llama8b's preset with three targets took 440 s); (2) the peer alone at C=32 and 64; (3) llama8b's preset
# again (session 20's ran before the grid growth and the frozen heaps), if
# 450 s are left, without the peer: session 20's peer run stands (the peer
# did not change); if not, the session after runs it. cuDNN's attention
# stays off (session 20: on, every new shape built a plan of 50-800 ms).
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
if [ "$(left)" -gt 1000 ]; then
  preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std 600
fi
peer qwen0.5b peer
try model-llama8b 300 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
if [ "$(left)" -gt 450 ]; then
  preset llama8b ceiling_alt,engine,mlxd sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix std-llama8b $(($(left) - 170))
fi
echo DONE >> "$R/steps"
