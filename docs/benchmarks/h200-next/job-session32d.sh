#!/bin/bash
# The final tree's kernel helpers on another shape (JOB_BUDGET_S about 180):
# qwen0.5b, mlxd alone, long_prefill, each start on an empty kernel cache of
# its own, the helpers on, then off (session 32's llama8b runs:
# ../h100-session32/kernel-warm/).
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
cold_start qwen-warm-on qwen0.5b ~/ptx-on true 60
cold_start qwen-warm-off qwen0.5b ~/ptx-off false 90
echo DONE >> "$R/steps"
