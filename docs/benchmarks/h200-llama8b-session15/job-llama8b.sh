#!/bin/bash
# For a llama8b GPU session after session 14 (JOB_BUDGET_S: the device
# seconds the job may use). Session 14's run (../h200-llama8b-session14/)
# measured the sweep with four targets (the ceiling with CUDA graphs on ran
# 14-38% below mlxd's own engine) and found what set the governor's
# temporary (the calibration's prefill passes, 6-22 GB at 2,048 tokens); the
# worker now learns scratch per prompt token per span instead. So: the
# standard preset with both ceilings (graphs on and off; the report measures
# mlxd against the faster) in the engine's place, interleaved, first and
# with most of the time (its
# mixed-pressure, cancellation and shared-prefix scenarios were cut last
# time), then the fused A/B on mixed pressure while time is left. mlxd.log's
# "new high" lines show what the new rule sets aside.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
TAIL=200  # after the deadline: the scenario under way, the targets' stopping, the report
RESERVE=500  # the fused A/B after it
timeout $(($(left) - RESERVE)) python3 -m bench run --preset standard --shape llama8b --quiet --interleave --targets ceiling,ceiling_alt,mlxd,peer --deadline-s $(($(left) - RESERVE - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-4 $?
fused_ab llama8b 220
echo DONE >> "$R/steps"
