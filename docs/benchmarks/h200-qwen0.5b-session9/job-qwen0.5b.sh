#!/bin/bash
# For the next GPU session (written in session 7). The standard preset on
# qwen0.5b with every target interleaved wave by wave (`--interleave`: session
# 7 found the machine's decode step drifting between 6.5 and 10.6 ms within one
# process, so targets run minutes apart gave ratios that meant little). Then
# the arrival window's A/B the same way: ceiling_alt and mlxd with the window
# off, interleaved; compare mlxd/ceiling_alt between the two runs (each ratio
# pairs waves seconds apart, so the drift cancels; raw tok/s across runs does
# not). A trace of C=4 and 16 between them: its "waves at the worker" table
# says whether a wave now comes out of one step. The prefix probe (session 8)
# alternates its conversations between the chunk start (a prompt's first
# token from its own pass, worker/fused.py) and mlx-lm's pass of its own over
# the last prompt token, in one process; then the pacing probe, fused and two
# passes. About 14 + 2 + 2 + 3 + 6 minutes: the window A/B comes last, the
# first to go if the device time runs short.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
B="python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave"
timeout 1080 $B --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
timeout 150 python3 -m bench.prefix_probe --model $M --conversations 4 --chunk-start both --out $R/prefix-probe.json > $R/prefix-probe.log 2>&1
step prefix-probe $?
timeout 150 python3 -m bench trace --preset standard --shape qwen0.5b --quiet --scenarios sweep_c4,sweep_c16 --out $R/trace > $R/trace.log 2>&1
step trace $?
# Fused or two passes, now that neither pays mlx-lm's pass over the last
# prompt token (session 8): mixed pressure in-process, both steps.
timeout 240 python3 -m bench.pacing_probe --model $M --fused both --out $R/pacing-fused.json > $R/pacing-fused.log 2>&1
step pacing-fused $?
timeout 480 $B --targets ceiling_alt,mlxd --mlxd-env MLXD_ARRIVAL_WINDOW_S=0 --out "$R/window-off" > "$R/window-off.log" 2>&1
step window-off $?
echo DONE >> "$R/steps"
