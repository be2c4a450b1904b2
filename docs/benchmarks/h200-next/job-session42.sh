#!/bin/bash
# Session 42's job for the next GPU session (`common.sh` `run_stages`;
# launch it as this folder's README says, then poll with poll-staged.sh):
# session 40's pass once more through the variant probe, its fused steps now
# matched by their place in the prompt (session 42's runs aliased them);
# then mlxd at session 42's defaults (`join_read` on, the rotary kernel off,
# the bound on a paced pass from paced passes only) on both shapes, then the
# 0.5B pacing frontier while time is left.
# About 550 s of job, more if the budget allows.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage42
echo DONE >> "$R/steps"
