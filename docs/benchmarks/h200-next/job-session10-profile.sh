#!/bin/bash
# Session 10, with the device time left after the final run (about 8
# minutes): where a paced step's time goes on the H200. The pacing probe with
# the mixed-pressure shape (16 streams, a 2,000-token prompt), two passes,
# uncalibrated then calibrated, with a cProfile of the slowest paced step and
# of a steady one (bench/pacing_probe.py --profile). About 2 minutes.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
timeout 200 python3 -m bench.pacing_probe --model $M --streams 16 --prompt 2000 --calibrate-s 1 --profile --out $R/pacing-profile.json > $R/pacing-profile.log 2>&1
step pacing-profile $?
echo DONE >> "$R/steps"
