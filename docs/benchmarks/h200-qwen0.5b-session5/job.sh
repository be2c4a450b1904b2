#!/bin/bash
# Session 5, job 2: the serving-path fix measured (diag), the standard preset on
# qwen0.5b (ceiling at MLX's defaults, engine, mlxd, peer), mlxd and engine with
# CUDA graphs on, the ceiling at mlxd's CUDA settings, a start-up probe, and a
# trace of the shared-prefix scenario.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd $HOME/proj
R=$HOME/R; mkdir -p $R
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
M=$(python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))")
step model $?
timeout 200 python3 docs/benchmarks/h200-qwen0.5b-serving/serving_diag.py $M $R/diag.json engine worker worker-pyswitch > $R/diag.log 2>&1
step diag $?
B="timeout 300 python3 -m bench run --preset standard --shape qwen0.5b --quiet"
$B --targets mlxd --out "$R/std" > "$R/mlxd.log" 2>&1
step mlxd $?
$B --targets engine --out "$R/std" > "$R/engine.log" 2>&1
step engine $?
$B --targets ceiling --out "$R/std" > "$R/ceiling.log" 2>&1
step ceiling-mlx-defaults $?
$B --targets peer --out "$R/std" > "$R/peer.log" 2>&1
step peer $?
$B --targets mlxd --mlxd-env MLXD_CUDA_GRAPHS=on --out "$R/graphs-on" > "$R/mlxd-graphs.log" 2>&1
step mlxd-graphs-on $?
MLX_USE_CUDA_GRAPHS=1 $B --targets engine --out "$R/graphs-on" > "$R/engine-graphs.log" 2>&1
step engine-graphs-on $?
MLX_USE_CUDA_GRAPHS=0 MLX_CUDA_USE_CUDNN_SDPA=0 $B --targets ceiling --out "$R/ceiling-mlxd-settings" > "$R/ceiling-mlxd-settings.log" 2>&1
step ceiling-mlxd-settings $?
timeout 60 python3 -X importtime -c "import worker.core" 2> $R/importtime.txt
python3 - > $R/startup-probe.txt 2>&1 <<'PY'
import time
t = time.monotonic(); import mlx.core as mx; a = time.monotonic()
mx.eval(mx.zeros(1)); b = time.monotonic()
import mlx_lm.models.cache; c = time.monotonic()
from mlx_lm.utils import load_tokenizer; from bench.models import shape_model
tok = load_tokenizer(shape_model("qwen0.5b")); d = time.monotonic()
print(f"import mlx.core {a-t:.2f}s; first GPU eval {b-a:.2f}s; import mlx_lm {c-b:.2f}s; bench tokenizer load {d-c:.2f}s")
PY
step startup-probe $?
timeout 150 python3 -m bench trace --preset standard --shape qwen0.5b --quiet --scenarios shared_prefix --out $R/trace > $R/trace.log 2>&1
step trace $?
echo DONE >> "$R/steps"
