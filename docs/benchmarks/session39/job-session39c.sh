#!/bin/bash
# Session 39's last device minutes (about 170 s of job): the pass in fewer
# graph nodes (worker/blocks.py) against session 38's on the 0.5B shape,
# the engine's steps first (bench.variant_probe rope,nodes), then the
# host's build and the nodes (bench.build_probe). job-session40.sh is the
# whole measurement, on both shapes.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
try variant-05b 70 python3 -m bench.variant_probe --shape qwen0.5b --variants rope,nodes --rounds 60 --prompt 2000 --out "$R/variant-05b.json"
try build-05b 90 python3 -m bench.build_probe --shape qwen0.5b --reps 150 --out "$R/build-05b.json"
echo DONE >> "$R/steps"
