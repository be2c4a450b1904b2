#!/bin/bash
# Session 23's third job (JOB_BUDGET_S about 170, the session's last device
# time): the 0.5B shape's C=32 sweep on a fresh machine (an empty kernel
# cache), interleaved with the graphs-off ceiling. The first job's C=32 wave
# held a 2.7 s step while MLX compiled `gather_int32_int32_1` (a row leaving
# from the middle of the batch); the warm-up now makes one leave so.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
try c32 $(($(left) - 15)) python3 -m bench run --preset standard --shape qwen0.5b --quiet \
  --interleave --step-trace --targets ceiling_alt,mlxd --scenarios sweep_c32 --out "$R/c32" \
  > "$R/c32.log" 2>&1
ls -la --time-style=+%H:%M:%S ~/.cache/mlxd/mlx-ptx/*/ > "$R/ptx-cache.txt" 2>&1
echo DONE >> "$R/steps"
