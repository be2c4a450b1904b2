#!/bin/bash
# The H200 standard-preset job (issue #12), run in the background from ~/proj.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd $HOME/proj
R=$HOME/R; mkdir -p $R
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
python3 -c "from bench.models import shape_model; shape_model('qwen0.5b')"
step model $?
B="python3 -m bench run --preset standard --shape qwen0.5b --quiet"
# 1. The ceiling at mlxd's CUDA settings (graphs off, cuDNN attention off), the
#    engine, mlxd and the peer: one directory, one report.
MLX_USE_CUDA_GRAPHS=0 MLX_CUDA_USE_CUDNN_SDPA=0 $B --targets ceiling --out "$R/std" > "$R/ceiling.log" 2>&1
step ceiling-mlxd-settings $?
$B --targets engine --out "$R/std" > "$R/engine.log" 2>&1
step engine $?
$B --targets mlxd --out "$R/std" > "$R/mlxd.log" 2>&1
step mlxd $?
$B --targets peer --out "$R/std" > "$R/peer.log" 2>&1
step peer $?
# 2. The ceiling at MLX's own defaults (graphs on, cuDNN attention on).
$B --targets ceiling --out "$R/ceiling-mlx-defaults" > "$R/ceiling-defaults.log" 2>&1
step ceiling-mlx-defaults $?
echo DONE >> "$R/steps"
