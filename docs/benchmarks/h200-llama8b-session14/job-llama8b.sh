#!/bin/bash
# For a llama8b GPU session after session 13 (JOB_BUDGET_S: the device
# seconds the job may use). Session 13's run (../h200-llama8b-session13/) was
# lost with its machine; its logs showed mlxd admitting about 8 requests at a
# time under its 27 GB share (the governor's `temporary`; the worker now logs
# each new high, docs/architecture.md "Memory governor") and an out-of-memory
# crash at C=64 with five targets alive. So: the prefix probe with idle_read
# off and on (--sync), mixed pressure through mlxd alone with the fused step
# on and off (mlxd.log's "governor's new temporary" lines say what set it
# with the whole GPU), then the standard preset with four targets (no
# ceiling_alt: 34 GB each), cut by a deadline near the job's end.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"  # h200-next/common.sh as of 54a626c
for mode in off on; do
  timeout 150 python3 -m bench.prefix_probe --model $M --conversations 2 --sync --idle-read $mode --out "$R/prefix-$mode-sync.json" > "$R/prefix-$mode-sync.log" 2>&1
  step "prefix-$mode-sync" $?
done
mp="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure"
timeout 240 $mp --mlxd-env MLXD_FUSED_STEP=on --out "$R/fused-on" > "$R/fused-on.log" 2>&1
step fused-on $?
timeout 240 $mp --mlxd-env MLXD_FUSED_STEP=off --out "$R/fused-off" > "$R/fused-off.log" 2>&1
step fused-off $?
TAIL=200  # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - 30)) python3 -m bench run --preset standard --shape llama8b --quiet --interleave --targets ceiling,engine,mlxd,peer --deadline-s $(($(left) - 30 - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-4 $?
echo DONE >> "$R/steps"
