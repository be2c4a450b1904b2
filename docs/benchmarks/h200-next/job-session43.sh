#!/bin/bash
# Session 43's job (`common.sh` `run_stages`; launch it as this folder's
# README says, then poll with poll-staged.sh). Session 42's job reordered for
# a short budget (four refused starts had spent a third of session 43's):
# mlxd at session 42's defaults on both shapes first, with the shared
# prefix; then a chunk step's primitives on CUDA; then the 0.5B pacing
# frontier; the variant probe last, while time is left.
# About 450 s for stages 1-2, 700 s with stage 3.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage43
echo DONE >> "$R/steps"
