#!/bin/bash
# Session 17's second short job: what MLX's CUDA backend charges the first
# time it meets a shape, op by op (bench.shape_probe), after job-anatomy.sh
# found that a second arrival of the same prompt cost 25-28 ms in the steps
# where the first cost 41-51 ms. llama8b twice (the first run also compiles
# the kernels of a fresh machine), then with every CUDA module loaded at
# start (is a first use lazy module loading?), then the 0.5B shape.
SHAPE=tiny  # no model needed: random tensors of the shapes
. "$(dirname "$0")/common.sh"
for i in 1 2; do
  timeout 120 python3 -m bench.shape_probe --shape llama8b --out "$R/shapes-l-$i.json" > "$R/shapes-l-$i.txt" 2>&1
  step shapes-l-$i $?
done
CUDA_MODULE_LOADING=EAGER timeout 120 python3 -m bench.shape_probe --shape llama8b --out "$R/shapes-l-eager.json" > "$R/shapes-l-eager.txt" 2>&1
step shapes-l-eager $?
timeout 90 python3 -m bench.shape_probe --shape qwen0.5b --out "$R/shapes-q.json" > "$R/shapes-q.txt" 2>&1
step shapes-q $?
echo DONE >> "$R/steps"
