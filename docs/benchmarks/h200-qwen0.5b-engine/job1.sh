#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd $HOME/proj
R=$HOME/R; mkdir -p $R
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))" > $R/model.txt 2>&1
step model $?
M=$(tail -1 $R/model.txt)
MLX_USE_CUDA_GRAPHS=0 RESULT=$R/diag-g0.json timeout 400 python3 docs/benchmarks/h200-qwen0.5b-engine/diag1.py $M > $R/diag-g0.log 2>&1
step g0 $?
MLX_USE_CUDA_GRAPHS=1 RESULT=$R/diag-g1.json timeout 400 python3 docs/benchmarks/h200-qwen0.5b-engine/diag1.py $M > $R/diag-g1.log 2>&1
step g1 $?
echo DONE >> $R/steps
