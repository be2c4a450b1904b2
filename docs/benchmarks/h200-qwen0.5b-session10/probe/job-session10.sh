#!/bin/bash
# For the next GPU session (written in session 9): what a prompt pass costs on
# the H200, split into the host's graph building and the device's run
# (bench/pass_probe.py), CUDA graphs off (mlxd's setting) and on, at warm
# shapes; then the shared-prefix probe. About 3 minutes. A warm turn over a
# cached 2,000-token history cost about what a cold 2,000-token prompt did
# (session 9): this says whether that fixed cost is the host's or the device's.
SHAPE=qwen0.5b
. "$(dirname "$0")/../../h200-next/common.sh"
MLX_USE_CUDA_GRAPHS=0 timeout 240 python3 -m bench.pass_probe --model $M --out $R/pass-graphs-off.json > $R/pass-graphs-off.log 2>&1
step pass-graphs-off $?
MLX_USE_CUDA_GRAPHS=1 timeout 240 python3 -m bench.pass_probe --model $M --out $R/pass-graphs-on.json > $R/pass-graphs-on.log 2>&1
step pass-graphs-on $?
timeout 90 python3 -m bench.prefix_probe --model $M --conversations 2 --out $R/prefix-probe.json > $R/prefix-probe.log 2>&1
step prefix-probe $?
echo DONE >> "$R/steps"
