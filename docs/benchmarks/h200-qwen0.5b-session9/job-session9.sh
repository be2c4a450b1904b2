#!/bin/bash
# Session 9, after the session's first job (../h200-qwen0.5b-session9/): the
# two engine changes measured on the H200, in about 4 minutes.
# - The prompt pass queued, not waited for (worker/fused.py, prefix_cache.py):
#   the pacing probe's paced step, fused and two passes.
# - A wave's tail no longer paced (EngineCore.streams): the sweep at C=8-64
#   beside the ceilings, interleaved; mixed pressure, cancellation and the
#   shared prefix (now with canned replies: bench/workload.py) on mlxd.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
timeout 120 python3 -m bench.pacing_probe --model $M --fused both --out $R/pacing-fused.json > $R/pacing-fused.log 2>&1
step pacing-fused $?
timeout 420 python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave \
  --targets ceiling,ceiling_alt,engine,mlxd \
  --scenarios sweep_c8,sweep_c16,sweep_c32,sweep_c64,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix \
  --out "$R/sel" > "$R/sel.log" 2>&1
step selected $?
timeout 60 python3 -m bench.prefix_probe --model $M --conversations 2 --out $R/prefix-probe.json > $R/prefix-probe.log 2>&1
step prefix-probe $?
echo DONE >> "$R/steps"
