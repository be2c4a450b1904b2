#!/bin/bash
# Session 44's job (`common.sh` `run_stages`; launch it as this folder's
# README says, then poll with poll-staged.sh): session 43's unrun job with
# session 44's prompt attention (worker/prompt_attention.py) checked on
# CUDA first, then measured against MLX's fallback in one engine on the
# 0.5B shape; then mlxd on both shapes, a chunk step's primitives on CUDA,
# the 0.5B pacing frontier, and last the 8B shape's A/B.
# About 60 s for stages 0-1, 500 s with stage 2, 800 s with stage 4.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage44
echo DONE >> "$R/steps"
