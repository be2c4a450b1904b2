#!/bin/bash
# Session 39's second staged job (job-session39.sh's design; common.sh
# `run_stages`): each layer's cache-free parts compiled (worker/blocks.py)
# against the same pass uncompiled, on both GPU shapes: the host's build
# time (bench.build_probe, both in alternation), the steps of one engine
# (bench.variant_probe rope,compiled, step by step), then mlxd itself on the
# scenarios job-session39.sh ran with graphs off, for a comparison across
# the two jobs' machines.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage39b
echo DONE >> "$R/steps"
