#!/bin/bash
# For the next GPU session after session 12 (about 20 minutes). Session 12
# changed the worker twice, neither measured on the GPU: MLX's memory limit is
# the worker's budget on CUDA (no effect expected for one worker alone), and
# MLX's cached buffers go back after 0.25 s idle instead of at once (a request
# that follows at once, as at C=1 and in the shared-prefix turns, no longer
# allocates every buffer anew). So: the prefix probe with --sync and without
# (session 12's ran before the change: a warm turn 20-32 ms, its stages outside
# the step 2 ms), then the standard preset, all five targets interleaved, cut
# cleanly by --deadline-s, then mixed pressure with the fused step on and off.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
timeout 120 python3 -m bench.prefix_probe --model $M --conversations 2 --sync --out $R/prefix-sync.json > $R/prefix-sync.log 2>&1
step prefix-sync $?
timeout 90 python3 -m bench.prefix_probe --model $M --conversations 2 --out $R/prefix-plain.json > $R/prefix-plain.log 2>&1
step prefix-plain $?
timeout 1000 python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave --deadline-s 780 --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
fused_ab qwen0.5b 150
echo DONE >> "$R/steps"
