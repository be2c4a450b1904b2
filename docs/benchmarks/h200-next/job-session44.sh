#!/bin/bash
# Session 44's job (`common.sh` `run_stages`; launch it as this folder's
# README says, then poll with poll-staged.sh): session 43's unrun job with
# session 44's prompt attention (worker/prompt_attention.py, off by
# default) checked on CUDA first, then measured against MLX's fallback in
# one engine on the 0.5B shape; then mlxd at the defaults on both shapes, a
# chunk step's primitives on CUDA with and without it, the 0.5B pacing
# frontier, mlxd's mixed pressure and shared prefix with it on and off, and last the 8B
# shape's in-engine A/B. About 250 s for stages 0-1, 700 s with stage 2,
# 1,000 s with stage 4: each stage runs while time is left.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage44
echo DONE >> "$R/steps"
