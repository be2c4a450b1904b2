#!/bin/bash
# Session 5, job 1: the serving-path diagnosis (issue #12 item 7).
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd $HOME/proj
R=$HOME/R; mkdir -p $R
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
lscpu > "$R/lscpu.txt"
M=$(python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
step model $?
python3 docs/benchmarks/h200-qwen0.5b-serving/serving_diag.py $M $R/diag.json engine engine+io worker worker-nommap worker-notrim worker-switch worker-graphs > $R/diag.log 2>&1
step diag $?
python3 -m bench trace --preset standard --shape qwen0.5b --quiet --scenarios sweep_c1,sweep_c4 --out $R/trace > $R/trace.log 2>&1
step trace $?
echo DONE >> "$R/steps"
