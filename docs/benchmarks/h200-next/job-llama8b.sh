#!/bin/bash
# For a llama8b GPU session after session 15 (JOB_BUDGET_S: the device
# seconds the job may use). Session 15's version (../h200-llama8b-session15/)
# gave the preset a 381 s deadline after 250 s of model creation and 500 s
# held back for the fused A/B, and four targets took 4 of those minutes to
# start: only C=1 ran. The A/B is decided (fused on for a single CUDA worker,
# worker/backend.py), so the whole budget goes to the standard preset, both
# ceilings (graphs on was the faster at C=64 in session 14, graphs off at
# C=1-32), mlxd and the peer, interleaved. mlxd.log's "new high" lines show
# what the scratch rule sets aside at C=32 and 64. The scenarios are the
# issue's targets' (session 14's run, cut at C=64, spent its tail on the
# sustained, non-streaming and slow-reader scenarios no target reads).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
TAIL=200  # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - 20)) python3 -m bench run --preset standard --shape llama8b --quiet --interleave --targets ceiling,ceiling_alt,mlxd,peer --scenarios sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix --step-trace --deadline-s $(($(left) - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-4 $?
echo DONE >> "$R/steps"
