#!/bin/bash
# Session 36's third job (JOB_BUDGET_S about 450, 900 with the decode_rows
# pair at the end): where the joining step's time goes. On the H100 (this
# session's first job, bench.admit_probe phases)
# the step after a 2,000-token prompt's last chunk took 15 ms against 6.6 for
# the decode step after it, with its join synchronised apart; on the H200
# (second job, mixed pressure through mlxd) that step was the streams'
# longest gap. The phases pass now times the runner's whole step, the decode
# batch's next() and its pass, and the prefix cache's insert, per step; the
# `host` pass times the same on the host alone, pipelined as served, with
# every blocking mx.eval summed (`_wait`): a stage that blocks on the device
# where serving expects none shows there (an implicit synchronisation: a
# managed-memory copy or free inside MLX's allocator is one suspect).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
try host-arrays 150 python3 -m bench.alloc_probe --shape llama8b --host-arrays --out "$R/alloc-host.json"
try admit-phases 200 python3 -m bench.admit_probe --shape llama8b --chunk 256 --prompts 2000 --reps 4 --passes default,phases,host --out "$R/admit-phases.json"
# If the machine has Nsight Systems: the same probe's pipelined pass under it,
# kept as its CUDA API and kernel summaries only (a hidden synchronisation is a
# long cudaMemcpy, cudaMallocManaged or cudaFree there).
if command -v nsys > /dev/null && [ "$(left)" -gt 300 ]; then
  timeout 200 nsys profile -t cuda -o "$HOME/admit-nsys" --force-overwrite true python3 -m bench.admit_probe --shape llama8b --chunk 256 --prompts 2000 --reps 2 --passes default > "$R/nsys.log" 2>&1
  step nsys $?
  timeout 90 nsys stats --report cuda_api_sum,cuda_gpu_kern_sum --format csv "$HOME/admit-nsys.nsys-rep" > "$R/nsys-stats.csv" 2>&1
  step nsys-stats $?
else
  step nsys-absent 0
fi
# decode_rows since session 36 keeps its rows' ends on the device between steps
# (no array from host data a step): one more pair, with sustained decode, to
# see whether the 1.2-1.4 ms a step it cost moved.
mp="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios mixed_pressure,sustained_decode --step-trace"
for v in on off; do
  [ "$(left)" -gt 220 ] || break
  timeout 200 $mp --mlxd-env "MLXD_DECODE_ROWS=$v" --out "$R/rows-$v" > "$R/rows-$v.log" 2>&1
  step "rows-$v" $?
done
echo DONE >> "$R/steps"
