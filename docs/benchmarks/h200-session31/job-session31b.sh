#!/bin/bash
# Session 31's second GPU job (JOB_BUDGET_S about 1,200): the qwen0.5b shape's
# whole standard preset on an H200 on the final engine (both ceilings, the
# engine and mlxd alive and interleaved: a 0.5B model leaves each target far
# more memory than it uses), then the peer alone at C=32 and 64 on the same
# machine, for mlxd/peer. The first job of the session (job-session31.sh)
# ran llama8b's remaining scenarios.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std-qwen0.5b $(($(left) - 330))
peer qwen0.5b peer-qwen0.5b
echo DONE >> "$R/steps"
