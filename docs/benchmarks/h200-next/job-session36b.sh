#!/bin/bash
# Session 36's second job (JOB_BUDGET_S about 800). The first showed, in
# llama8b's step traces on an H100, decode steps whose KV buffers grew by
# their 256 slots at 21-24 ms against 11.5 around them, and a joining step
# at 15 ms against 6.6 with its join synchronised apart; bench/cuda_pool.py
# has the suspect (CUDA's pool hands freed memory back at every
# synchronisation, so each new buffer size maps fresh memory). First the
# growths alone (bench.alloc_probe, the pool as MLX leaves it, then keeping
# freed memory), then mlxd with `cuda_keep_freed` on and off, alternated.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
for v in default keep; do
  flag=""; [ $v = keep ] && flag=--keep-freed
  timeout 150 python3 -m bench.alloc_probe --shape llama8b $flag --out "$R/alloc-$v.json" > "$R/alloc-$v.log" 2>&1
  step "alloc-$v" $?
done
mp="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure,sustained_decode --step-trace"
for i in 1 2; do
  for v in on off; do
    [ "$(left)" -gt 220 ] || break
    timeout 200 $mp --mlxd-env "MLXD_CUDA_KEEP_FREED=$v" --out "$R/keep-$v-$i" > "$R/keep-$v-$i.log" 2>&1
    step "keep-$v-$i" $?
  done
done
echo DONE >> "$R/steps"
