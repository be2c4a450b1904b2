#!/bin/bash
# The last upload call's work on the lent machine (gpu.md's install): joins
# the CUDA wheel's parts staged in ~/stage, installs every wheel into ~/site,
# and starts JOB (a path under ~/proj) in its own session with BUDGET seconds:
# launch.sh JOB BUDGET. The job writes ~/R/steps, ending in DONE.
set -e
cd ~/stage
cat part_a? > mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
rm -f part_a?
python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site ./*.whl > ~/pip.log 2>&1
ls ~/site | head -40 >> ~/pip.log
(JOB_BUDGET_S=$2 setsid nohup bash "$HOME/proj/$1" > ~/job.log 2>&1 < /dev/null &)
echo "launched $1 with $2 s"
