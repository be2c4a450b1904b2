#!/bin/bash
# For the GPU session after session 24 (JOB_BUDGET_S about 1,600): both
# shapes' standard presets on the engine as it stands (session 24 added the
# prompt's KV buffer grown once, `reserve`, which changes every paced step's
# kernels: 64 fills and 64 copies fewer on llama8b in each step whose chunk
# crosses a 256-slot step), for issue #12's "results from the engine as it
# stands". (1) the 0.5B shape interleaved with both ceilings, the engine
# and mlxd, 600 s deadline (session 24: 419 s, every scenario; on a fresh
# machine the engine target's warm-up compiles the kernels, about 30 s).
# (2) llama8b with the graphs-off ceiling, the engine and mlxd (four 8B
# targets on one GPU ran out of memory in session 16), every scenario but
# the sustained and slow-reader ones, cut by what time is left. (3) the
# peer alone at C=32 and 64 on llama8b (mlxd/peer on that shape). (4) below.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
if [ "$(left)" -gt 1100 ]; then
  preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std 600
fi
try model-llama8b 300 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
if [ "$(left)" -gt 450 ]; then
  preset llama8b ceiling_alt,engine,mlxd sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix std-llama8b $(($(left) - 300))
fi
peer llama8b peer-llama8b
# (4) session 24's q and k rotated as one against apart, step by step in one
# engine, if time is left (session 23's variants took about 150 s a shape).
if [ "$(left)" -gt 200 ]; then
  try variants-llama8b 180 python3 -m bench.variant_probe --shape llama8b --streams 16 --rounds 60 \
    --prompt 2000 --chunk 256 --variants joined,rope --out "$R/variants-llama8b.json" > "$R/variants-llama8b.txt" 2>&1
fi
echo DONE >> "$R/steps"
