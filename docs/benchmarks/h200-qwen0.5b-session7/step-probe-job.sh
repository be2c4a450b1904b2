#!/bin/bash
# Session 7's step probe on the H200, as it ran (its script then was an ad-hoc
# copy of what is now bench/step_probe.py; the commands below are today's
# equivalent). Output: step-probe.txt (its labels are the ad-hoc script's).
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd "$HOME/proj" || exit 1
S=qwen0.5b
for N in 32 16; do
  python3 -m bench.step_probe $S ceiling $N
  python3 -m bench.step_probe $S engine $N
done
MLXD_STEP_PROBE_VARLEN=1 python3 -m bench.step_probe $S ceiling 32
MLXD_STEP_PROBE_VARLEN=1 python3 -m bench.step_probe $S engine 32
MLXD_STEP_PROBE_PROFILE=1 python3 -m bench.step_probe $S engine 32
