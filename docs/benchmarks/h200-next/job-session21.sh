#!/bin/bash
# For the GPU session after job-session20.sh (JOB_BUDGET_S: the device
# seconds the job may use): the 0.5B shape's standard preset on the engine
# as it now stands (session 17 ran it last; since then the planner's reach,
# the decode attention kernel, grouped since session 19, and the prompt
# tokens' reuse), interleaved with both ceilings (the graphs-on one was the
# faster at C=1 there), the engine and mlxd, cut by a deadline; then the
# peer alone at C=32 and 64 in its own directory. If job-session20.sh found
# cuDNN's attention better and the default changed, this measures the new
# default; otherwise add `MLX_CUDA_USE_CUDNN_SDPA=1` runs beside it as there.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
preset_and_peer qwen0.5b ceiling,ceiling_alt,engine,mlxd
echo DONE >> "$R/steps"
