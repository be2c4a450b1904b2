#!/bin/bash
# Session 18's second job (JOB_BUDGET_S: the device seconds the job may use),
# on the time job-session18.sh left: the decode attention kernel
# (worker/decode_attention.py, `decode_attention`), built this session and
# never run. (1) bench.decode_probe on both shapes' dimensions: each batch's
# attention over every layer through MLX's path and through the kernel, and
# the largest difference between them; (2) in-process decode steps
# (bench.step_probe, the engine, 16 rows of 32-511 tokens) with mlx-lm's
# attention and with the kernel, alternated; (3) through mlxd, C=16 and
# mixed pressure (a 2,000-token row joins 16 streams: the case the kernel
# is for) with the kernel and without, alternated while time is left.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
for s in qwen0.5b llama8b; do
  timeout 120 python3 -m bench.decode_probe --shape $s --reps 20 --out "$R/decode-$s.json" > "$R/decode-$s.txt" 2>&1
  step decode-$s $?
done
for i in 1 2; do
  for a in mlx ragged; do
    MLXD_DECODE_ATTENTION=$a MLXD_STEP_PROBE_VARLEN=1 MLXD_STEP_PROBE_REPS=4 timeout 90 python3 -m bench.step_probe qwen0.5b engine 16 > "$R/step-$a-$i.txt" 2>&1
    step step-$a-$i $?
  done
done
for i in 1 2; do
  for a in mlx ragged; do
    [ "$(left)" -gt 100 ] || break 2
    timeout $(($(left) - 10)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave --targets mlxd --mlxd-env MLXD_DECODE_ATTENTION=$a --step-trace --scenarios sweep_c16,long_prefill,mixed_pressure --deadline-s $(($(left) - 70)) --out "$R/mlxd-$a-$i" > "$R/mlxd-$a-$i.log" 2>&1
    step mlxd-$a-$i $?
  done
done
echo DONE >> "$R/steps"
