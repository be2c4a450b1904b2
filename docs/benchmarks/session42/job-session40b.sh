#!/bin/bash
# Session 40's second staged job (common.sh `run_stages`; launch it as the
# h200-next README says, then poll with poll-staged.sh): the CUDA kernels'
# tests, session 40's decode pass (worker/fused.py `buffer_decode`,
# worker/decode_rotary.py) against session 39's in the variant and build
# probes on both shapes, then (session 41) a `bench trace` of the 0.5B long
# prompt under mixed pressure, mlxd itself on both shapes, `join_read` on and
# off on both shapes, and the 0.5B pacing frontier while time is left.
# About 700 s of job, more if the budget allows.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage40b
echo DONE >> "$R/steps"
