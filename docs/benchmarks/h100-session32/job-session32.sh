#!/bin/bash
# For the GPU session after session 31 (JOB_BUDGET_S about 1,300-1,600): does
# pricing a paced step's admissions (`admission_cost`, worker/scheduler.py,
# off by default) hold the streams' gap under mixed pressure? Session 31's
# traces: the step that admits the long prompt took about 1.6x what the cost
# model predicted on both shapes (llama8b on the H200: 23.9 ms against 16.2,
# the streams' p99 gap 2.35x steady; 0.5B on an H100: 11.5 against 8.1, 2.21x),
# and replayed over 30 traces the term cut the prediction error from 0.318 to
# 0.206 (bench.cost_replay, admit-term). mlxd alone, long_prefill and
# mixed_pressure, off and on alternated a pair at a time, llama8b first.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
admission_ab() {
  local mp="python3 -m bench run --preset standard --shape $1 --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace"
  for i in 1 2; do
    for mode in false true; do
      [ "$(left)" -gt $(($2 + 60)) ] || return
      timeout "$2" $mp --mlxd-env MLXD_ADMISSION_COST=$mode --out "$R/$1-admit-$mode-$i" > "$R/$1-admit-$mode-$i.log" 2>&1
      step "$1-admit-$mode-$i" $?
    done
  done
}
admission_ab llama8b 200
M=$(timeout 300 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
step model-qwen0.5b $?
admission_ab qwen0.5b 120
# Which kernels a fresh machine compiles, and when (session 31: 27 s of
# llama8b's first warm-up): every PTX file MLX wrote, with its write time.
find ~ /tmp -name '*.ptx' -printf '%TT %s %p\n' 2>/dev/null | sort > "$R/ptx-files.txt"
echo DONE >> "$R/steps"
