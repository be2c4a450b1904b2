#!/bin/bash
# Session 11's final GPU job (about 13 minutes): the standard preset on
# qwen0.5b, all five targets interleaved wave by wave, on the engine as it
# stands at the end of the session (the padding guard with one row index for
# all layers, timed calibration); then the pacing probe with its profile, to
# compare the finishing step with this session's first job (50 ms, 10 ms of it
# in per-layer list indexing).
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
timeout 1000 python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
timeout 150 python3 -m bench.pacing_probe --model $M --streams 16 --prompt 2000 --calibrate-s 1 --profile --out $R/pacing-profile.json > $R/pacing-profile.log 2>&1
step pacing-profile $?
echo DONE >> "$R/steps"
