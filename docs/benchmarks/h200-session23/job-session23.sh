#!/bin/bash
# Session 23's job (JOB_BUDGET_S about 1,400). (1) Joined projections
# (worker/joined.py: q/k/v as one matmul, gate/up as another, four
# projections a layer instead of seven) against the fused step without them,
# in one process per shape (session 22: each process runs at one of two
# speeds, so an A/B between processes split by it): the pacing probe
# synchronised, thin32 then llama8b, joins off,on,on,off, with their own
# kernel cache (so (2) meets a cold one). (2) The 0.5B shape's standard
# preset, interleaved, on the engine as it now stands (lean decode, joined
# projections, the warm-up that samples and retires a row beside a decoding
# one): sessions 21 and 22 met a step of 2.7-6.7 s in the first C=64 wave
# on a fresh machine, MLX compiling two gather kernels mid-run. (3)
# llama8b's standard preset if 450 s are left.
SHAPE=thin32
. "$(dirname "$0")/common.sh"
probe() {  # NAME SHAPE SECONDS
  MLX_PTX_CACHE_DIR=$HOME/ptx-probe try "$1" "$3" python3 -m bench.pacing_probe --shape "$2" \
    --fused on --join off,on,on,off --streams 16 --prompt 2000 --calibrated-only --calibrate-s 2 \
    --repeat 2 --long-tokens 64 --after 6 --chunk 256 --sync --count-ops \
    --out "$R/$1.json" > "$R/$1.txt" 2>&1
}
probe join-thin32 thin32 200
try model-llama8b 400 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
probe join-llama8b llama8b 300
try model-qwen0.5b 300 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))"
if [ "$(left)" -gt 700 ]; then
  preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std 480
fi
ls -la ~/.cache/mlxd/mlx-ptx/*/ > "$R/ptx-cache.txt" 2>&1
if [ "$(left)" -gt 450 ]; then
  preset llama8b ceiling_alt,engine,mlxd sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix std-llama8b $(($(left) - 170))
fi
echo DONE >> "$R/steps"
