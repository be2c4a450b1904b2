#!/bin/bash
# Session 5, job 3 (short): cancellation and shared prefix through mlxd after the
# deferred prefix-cache insert and the early tokenizer (traced run).
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd $HOME/proj
R=$HOME/R; mkdir -p $R
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
M=$(python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
step model $?
timeout 150 python3 -m bench trace --preset standard --shape qwen0.5b --quiet --scenarios cancel_decode,cancel_prefill,shared_prefix --out $R/trace > $R/trace.log 2>&1
step trace $?
gzip -f $R/trace/trace.json $R/trace/gateway-trace.json
echo DONE >> "$R/steps"
