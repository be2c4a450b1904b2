#!/bin/bash
# Session 11's first GPU job (about 4 minutes): where a paced step's and a warm
# shared-prefix turn's time go on the H200, on the engine as session 10 left it
# (the padding guard and timed calibration, neither measured on the GPU yet).
# 1. The pacing probe at the mixed-pressure shape (16 streams, a 2,000-token
#    prompt), uncalibrated then calibrated, with a cProfile of the slowest paced
#    step and of a steady one.
# 2. The prefix probe with a cProfile of the slowest warm turn, add to first token.
# 3. A trace of the shared-prefix scenario through mlxd: the warm turn's TTFT
#    split into tokenize, queue, worker and delivery.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
timeout 200 python3 -m bench.pacing_probe --model $M --streams 16 --prompt 2000 --calibrate-s 1 --profile --out $R/pacing-profile.json > $R/pacing-profile.log 2>&1
step pacing-profile $?
timeout 150 python3 -m bench.prefix_probe --model $M --conversations 4 --profile --out $R/prefix-probe.json > $R/prefix-probe.log 2>&1
step prefix-probe $?
timeout 200 python3 -m bench trace --preset standard --shape qwen0.5b --quiet --scenarios shared_prefix,mixed_pressure --out $R/trace > $R/trace.log 2>&1
step trace $?
echo DONE >> "$R/steps"
