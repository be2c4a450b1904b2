#!/bin/bash
# The next staged job (session 39's design, ../session39/job-session39b.sh;
# common.sh `run_stages`; launch it as the h200-next README says, then
# poll with poll-staged.sh). Measures session 39's pass in fewer graph
# nodes (worker/blocks.py: weights transposed once, residuals added in
# the GEMMs) against session 38's on both GPU shapes: the host's build
# time and the pass's nodes (bench.build_probe, both in alternation), the
# engine's steps (bench.variant_probe rope,nodes, step by step), then
# mlxd itself. About 450 s of job.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage40
echo DONE >> "$R/steps"
