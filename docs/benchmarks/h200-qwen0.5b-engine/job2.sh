#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd $HOME/proj
R=$HOME/R; mkdir -p $R
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))" > $R/model.txt 2>&1
step model $?
M=$(tail -1 $R/model.txt)
for g in 1 0; do for s in 0 1; do
MLX_USE_CUDA_GRAPHS=$g MLX_CUDA_USE_CUDNN_SDPA=$s MLX_ENABLE_CACHE_THRASHING_CHECK=0 RESULT=$R/d2-g$g-s$s.json timeout 300 python3 docs/benchmarks/h200-qwen0.5b-engine/diag2.py $M > $R/d2-g$g-s$s.log 2>&1
step g$g-s$s $?
done; done
echo DONE >> $R/steps
