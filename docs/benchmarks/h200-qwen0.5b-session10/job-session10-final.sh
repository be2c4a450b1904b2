#!/bin/bash
# Session 10's run of the engine as it stands at the end (issue #12's "must
# show" for qwen0.5b): the standard preset with every target interleaved (about
# 11 minutes), then the pass probe with the join (how much a prompt joining the
# decode batch costs), then fused steps on against mixed pressure through
# mlxd (the first to go if the device time runs short).
SHAPE=qwen0.5b
. "$(dirname "$0")/../h200-next/common.sh"
B="python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave"
timeout 900 $B --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
MLX_USE_CUDA_GRAPHS=0 timeout 120 python3 -m bench.pass_probe --model $M --reps 6 --out $R/pass-join.json > $R/pass-join.log 2>&1
step pass-join $?
timeout 240 $B --targets mlxd --scenarios long_prefill,mixed_pressure,cancel_prefill --mlxd-env MLXD_FUSED_STEP=on --out "$R/fused-on" > "$R/fused-on.log" 2>&1
step fused-on $?
echo DONE >> "$R/steps"
