#!/bin/bash
# Ran from docs/benchmarks/h200-next/ (it sources common.sh there), tree 6a8c521.
# For a GPU session of its own (session 13's version; JOB_BUDGET_S: the
# device seconds the job may use). First the in-process prefix probe with
# --sync (a warm 32-token turn cost a median 32 ms on this shape in session
# 12, the cold 2,000-token one 70-75 ms), then the standard preset on the
# llama8b shape (bf16 random weights, 16 GB), every target alive at once and
# interleaved wave by wave, each held to its share of the GPU (bench/run.py
# memory_share: session 12's first try ran the H200 out of memory), cut by a
# deadline near the job's end (session 12's run, with three targets dead,
# took 17 minutes); then, if a pair's time is left, mixed pressure through
# mlxd alone with the fused step on and off (on this compute-bound shape the
# decode rows should ride in the prompt pass nearly free: docs/architecture.md,
# "Why separate passes cannot meet both mixed-pressure targets"); then the
# pass probe while time is left.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
timeout 120 python3 -m bench.prefix_probe --model $M --conversations 2 --sync --out $R/prefix-sync.json > $R/prefix-sync.log 2>&1
step prefix-sync $?
TAIL=200  # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - 30)) python3 -m bench run --preset standard --shape llama8b --quiet --interleave --deadline-s $(($(left) - 30 - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
fused_ab llama8b 200
[ "$(left)" -gt 100 ] && timeout $(($(left) - 20)) python3 -m bench.pass_probe --model $M --reps 6 --out $R/pass-probe.json > $R/pass-probe.log 2>&1
step pass-probe $?
echo DONE >> "$R/steps"
