#!/bin/bash
# A staged job (session 38's design, ../session38/job-session38.sh; common.sh `run_stages`): the
# stages in stage39/ run one after another, in name order, each sourced in
# a subshell with common.sh's functions, until the budget ends or a stage
# whose name holds "last" has run. The stages in the tree at launch run at
# once; each poll call (poll-staged.sh) brings the session's work tree to
# ~/incoming, so a stage (and code) written while the job runs is run next,
# the tree copied to ~/proj first.
#
# Planned (session 38's finding: a CUDA step is bound by the host's work,
# docs/benchmarks/README.md): 01, CUDA graphs on and off through mlxd on
# the 0.5B shape (mixed pressure, long prefill, C=16 and 64), alternated
# twice; 02, a pair or two on llama8b; 03, bench.build_probe on both.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
run_stages docs/benchmarks/h200-next/stage39
echo DONE >> "$R/steps"
