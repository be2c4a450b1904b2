#!/bin/bash
# For the GPU session after session 30 (JOB_BUDGET_S about 1,300-1,600):
# llama8b's preset finished with two targets alive at a time. Session 30's
# H200 ran the sweep at C=1-32 and long_prefill clean with the graphs-off
# ceiling, the engine and mlxd alive together (`../h200-session30/`), and
# the engine's C=64 too; at C=64 the ceiling and the engine held 46.5 and
# 49.8 GB against their 43.1 GB shares, the device filled, and mlxd's
# worker (22.6 GB) died of cudaMallocAsync three times. On the H100 the
# three 8B targets did not even fit mlxd's warm-up. So: (1) the graphs-off
# ceiling and mlxd alone, C=64 and every other scenario but the sustained
# and slow-reader ones; (2) the peer alone at C=32 and 64 (mlxd/peer on one
# machine); (3) if time is left, the engine beside the graphs-off ceiling at
# C=64 again and the mixed pressure in-process (engine/ceiling).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
if [ "$(left)" -gt 500 ]; then
  preset llama8b ceiling_alt,mlxd sweep_c64,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix mlxd-llama8b $(($(left) - 400))
fi
peer llama8b peer-llama8b
if [ "$(left)" -gt 300 ]; then
  preset llama8b ceiling_alt,engine sweep_c64,long_prefill engine-llama8b $(($(left) - 200))
fi
echo DONE >> "$R/steps"
