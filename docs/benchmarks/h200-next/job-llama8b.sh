#!/bin/bash
# Prepared in session 6 (not run: no machine was lent). The standard preset on
# the llama8b shape (bf16 random weights, 16 GB): mlxd, engine, ceiling_alt
# (mlxd's CUDA settings; graphs off was faster at every batch for this shape in
# /work/shared/gpu.md's table), the peer, then the ceiling at MLX's defaults
# if time is left (the report then uses the faster per scenario). About 20 minutes with the model's creation: a session of its own.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
B="timeout 420 python3 -m bench run --preset standard --shape llama8b --quiet"
$B --targets mlxd --out "$R/std" > "$R/mlxd.log" 2>&1
step mlxd $?
$B --targets engine --out "$R/std" > "$R/engine.log" 2>&1
step engine $?
$B --targets ceiling_alt --out "$R/std" > "$R/ceiling-alt.log" 2>&1
step ceiling-alt $?
timeout 500 python3 -m bench run --preset standard --shape llama8b --quiet --targets peer --out "$R/std" > "$R/peer.log" 2>&1
step peer $?
timeout 120 python3 -m bench.prefix_probe --model $M --out $R/prefix-probe.json > $R/prefix-probe.log 2>&1
step prefix-probe $?
$B --targets ceiling --out "$R/std" > "$R/ceiling.log" 2>&1
step ceiling $?
echo DONE >> "$R/steps"
