#!/bin/bash
# For a GPU session of its own (written in session 6, made interleaved in
# session 7). The standard preset on the llama8b shape (bf16 random weights,
# 16 GB), every target alive at once and interleaved wave by wave: five copies
# of the weights (about 80 GB) plus each one's KV fit the H200's 141 GB. Then
# the shared-prefix probe. About 20-25 minutes with the model's creation
# (an estimate: never run). Trimmed in session 11 to fit one session's 30
# device-minutes after a fresh machine's start (60-260 s) and the staging.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
timeout 1150 python3 -m bench run --preset standard --shape llama8b --quiet --interleave --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
timeout 100 python3 -m bench.prefix_probe --model $M --out $R/prefix-probe.json > $R/prefix-probe.log 2>&1
step prefix-probe $?
echo DONE >> "$R/steps"
