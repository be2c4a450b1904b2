#!/bin/bash
# Session 20's third job, on its last device-seconds (JOB_BUDGET_S about
# 120). Through mlxd the warm shared-prefix turn took 21-46 ms a step on
# llama8b where the in-process probe took 18-23 (its admission 1 ms). Since
# then the worker and the gateway freeze their heaps once serving (a full
# collection walked their 80,000-110,000 objects in 26-46 ms on the CPU).
# (1) mlxd on the shared-prefix scenario alone, with the step trace; (2)
# the prefix probe without --sync (work queued before a turn lands in it).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
try mlxd-prefix 70 python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --step-trace --scenarios shared_prefix --out "$R/mlxd-prefix" > "$R/mlxd-prefix.log" 2>&1
try prefix-nosync 45 python3 -m bench.prefix_probe --shape llama8b --conversations 2 --reply-as other --out "$R/prefix-nosync.json" > "$R/prefix-nosync.txt" 2>&1
echo DONE >> "$R/steps"
