#!/bin/bash
# For a GPU session of its own (session 12's version). The standard preset on
# the llama8b shape (bf16 random weights, 16 GB), every target alive at once
# and interleaved wave by wave, each held to its share of the GPU (bench/run.py
# memory_share: session 12's first try ran the H200 out of memory, five
# processes each keeping freed buffers). --deadline-s ends it cleanly before
# the device time runs out (session 12's run took 17 minutes with three
# targets dead; all five alive take longer). Then the in-process prefix probe
# with --sync, then mixed pressure through mlxd alone with the fused step on
# and off, alternated (on this compute-bound shape the decode rows should ride
# in the prompt pass nearly free: docs/architecture.md, "Why separate passes
# cannot meet both mixed-pressure targets"), as long as the time lasts.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
timeout 1300 python3 -m bench run --preset standard --shape llama8b --quiet --interleave --deadline-s 1020 --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
timeout 100 python3 -m bench.prefix_probe --model $M --sync --out $R/prefix-sync.json > $R/prefix-sync.log 2>&1
step prefix-sync $?
fused_ab llama8b 200
echo DONE >> "$R/steps"
