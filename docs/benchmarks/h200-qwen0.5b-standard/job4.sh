#!/bin/bash
# Session 4, second H200 job (issue #12): the fused step in-process and through
# mlxd, then a trace of the serving path at C=1 and 16.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd $HOME/proj
R=$HOME/R; mkdir -p $R
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
python3 -c "from bench.models import shape_model; shape_model('qwen0.5b')"
step model $?
timeout 200 python3 -m bench.pacing_probe --shape qwen0.5b --fused both --streams 16 --prompt 2000 --out $R/probe-fused.json > $R/probe.log 2>&1
step probe $?
timeout 200 python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets mlxd --mlxd-env MLXD_FUSED_STEP=on --out $R/std-fused > $R/std-fused.log 2>&1
step mlxd-fused $?
timeout 180 python3 -m bench trace --preset standard --shape qwen0.5b --quiet --scenarios sweep_c1,sweep_c16 --out $R/trace > $R/trace.log 2>&1
step trace $?
echo DONE >> $R/steps
