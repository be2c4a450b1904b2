#!/bin/bash
# The H200 job behind this directory's results (issue #12). Run on the GPU machine
# from the project root with MLX's wheels on PYTHONPATH (/work/shared/gpu.md), in
# the background; it writes $HOME/R and appends each finished step to $HOME/R/steps.
#   (setsid nohup bash docs/benchmarks/h200-qwen0.5b-standard/job.sh > ~/job.log 2>&1 < /dev/null &)
set -x
export PYTHONUNBUFFERED=1
R=$HOME/R
mkdir -p "$R"
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
python3 -c "from bench.models import shape_model; shape_model('qwen0.5b')"
step model $?
B="python3 -m bench run --preset standard --shape qwen0.5b --quiet"
# 1. The ceiling with MLX's default CUDA graphs (on), in its own directory. As the
#    first MLX process on a fresh machine it also fills MLX's on-disk kernel cache
#    (its untimed prewarm pays the compiles).
$B --targets ceiling --out "$R/ceiling-graphs-on" > "$R/ceiling-graphs-on.log" 2>&1
step ceiling-graphs-on $?
# 2. The ceiling with CUDA graphs off, the engine and mlxd (both run with graphs
#    off: worker/backend.py's "auto"), into one directory and one report.
MLX_USE_CUDA_GRAPHS=0 $B --targets ceiling --out "$R/std" > "$R/ceiling.log" 2>&1
step ceiling-graphs-off $?
$B --targets engine --out "$R/std" > "$R/engine.log" 2>&1
step engine $?
$B --targets mlxd --out "$R/std" > "$R/mlxd.log" 2>&1
step mlxd $?
echo DONE >> "$R/steps"
