#!/bin/bash
# Session 22's second job, on what the first left (JOB_BUDGET_S about 1,150).
# The first found a step bound by the primitives MLX evaluates (thin32, whose
# matmuls cost next to nothing, decoded 16 rows in 8.2 ms against llama8b's
# 9.2): (1) what a primitive costs by kind (bench.launch_probe), CUDA graphs
# off (the worker's mode) and on; (2) the pacing probe with the worker's
# decode attention (the probe ran MLX's before), each step synchronised
# (its host part against its whole), thin32 and llama8b, graphs off and on;
# (3) the 0.5B shape's C=16 and C=64 sweeps interleaved with the graphs-off
# ceiling: session 21's first C=64 wave through mlxd held one step of 3.09 s
# (mlxd/ceiling 0.684 +- 0.556, its two other waves 1.03): again?
SHAPE=thin32
. "$(dirname "$0")/common.sh"
try launch-off 120 python3 -m bench.launch_probe --out "$R/launch-off.json" > "$R/launch-off.txt" 2>&1
MLX_USE_CUDA_GRAPHS=1 try launch-on 120 python3 -m bench.launch_probe --out "$R/launch-on.json" \
  > "$R/launch-on.txt" 2>&1
probe() {  # NAME SHAPE SECONDS [extra args]
  local name=$1 shape=$2 need=$3
  shift 3
  try "$name" "$need" python3 -m bench.pacing_probe --shape "$shape" --fused on --streams 16 \
    --prompt 2000 --calibrated-only --calibrate-s 2 --repeat 2 --long-tokens 64 --after 6 \
    --chunk 256 --count-ops "$@" --out "$R/$name.json" > "$R/$name.txt" 2>&1
}
probe thin-sync thin32 120 --sync
MLX_USE_CUDA_GRAPHS=1 probe thin-graphs thin32 150 --sync
try model-llama8b 400 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
probe l8-sync llama8b 150 --sync
MLX_USE_CUDA_GRAPHS=1 probe l8-graphs llama8b 200 --sync
try model-qwen0.5b 300 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))"
try c64 330 python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave \
  --step-trace --targets ceiling_alt,mlxd --scenarios sweep_c16,sweep_c64 --out "$R/c64" \
  > "$R/c64.log" 2>&1
echo DONE >> "$R/steps"
