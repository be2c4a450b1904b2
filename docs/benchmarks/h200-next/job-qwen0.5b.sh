#!/bin/bash
# For the next GPU session (JOB_BUDGET_S: the device seconds the job may use).
# Session 15 ran common.sh's drift probe, a cold and a warm start and the
# pacing probe on this shape (../h200-qwen0.5b-session15/); mlxd's scenarios
# were cut. Note: the preset's mlxd is now fused by default.
# Sessions 12-13 changed the worker three times, none measured on the GPU:
# MLX's memory limit is the worker's budget on CUDA (no effect expected for
# one worker alone), MLX's cached buffers go back after 0.25 s idle instead of
# at once, and an idle step reads its first tokens before building the next
# pass (`idle_read`, session 13; on this shape a pass costs 9-14 ms however
# small, so a warm shared-prefix turn should lose about one). So: the prefix
# probe with --sync and without, idle_read off and on alternated (session
# 12's: a warm turn 20-32 ms, its stages outside the step 2 ms), then the
# standard preset, all five targets interleaved, cut by a deadline that
# leaves a fused pair's time, then mixed pressure with the fused step on and
# off.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
# Where a fused prompt's first and finishing steps go (session 15: 29 and 38
# ms against 28 for the one between; through mlxd on llama8b 56-63 ms against
# about 30): the slowest paced step's cProfile, fused on.
timeout 150 python3 -m bench.pacing_probe --shape qwen0.5b --fused on --streams 16 --prompt 2000 --profile --out "$R/pacing-profile.json" > "$R/pacing-profile.txt" 2>&1
step pacing-profile $?
for i in 1; do
  for mode in off on; do
    for sync in --sync ""; do
      name=prefix-$mode${sync:+-sync}-$i
      timeout 120 python3 -m bench.prefix_probe --model $M --conversations 2 --idle-read $mode $sync --out "$R/$name.json" > "$R/$name.log" 2>&1
      step "$name" $?
    done
  done
done
FUSED=330  # one fused pair (2 x 150 s) and its margin
TAIL=150   # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - FUSED)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave --step-trace --deadline-s $(($(left) - FUSED - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-all $?
fused_ab qwen0.5b 150  # fused is on by default on CUDA since session 15: the 0.5B shape's check
echo DONE >> "$R/steps"
