#!/bin/bash
# Session 15's second, short job (the device time its llama8b job left), on
# the 0.5B shape: the drift probe (common.sh); mlxd started twice, on long
# prefill alone (the first start compiles MLX's CUDA kernels into
# ~/.cache/mlxd/mlx-ptx, the second should find them: warm-up 17.7 s against
# 2.2-2.5 s on llama8b); the pacing probe, two passes and fused, every step of
# a 2,000-token prompt beside 16 streams (llama8b: the first and the
# finishing step of a prompt cost 2-4x the paced steps between them); then
# mlxd's own scenarios until the budget ends.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
drift_probe qwen0.5b
for i in cold warm; do
  timeout 90 python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets mlxd --scenarios long_prefill --out "$R/start-$i" > "$R/start-$i.log" 2>&1
  step "start-$i" $?
done
timeout 120 python3 -m bench.pacing_probe --shape qwen0.5b --fused both --streams 16 --prompt 2000 --out "$R/pacing.json" > "$R/pacing.log" 2>&1
step pacing $?
timeout $(($(left) - 15)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix --out "$R/mlxd-scen" > "$R/mlxd-scen.log" 2>&1
step mlxd-scen $?
echo DONE >> "$R/steps"
