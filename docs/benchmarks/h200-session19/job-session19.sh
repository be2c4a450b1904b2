#!/bin/bash
# For the next GPU session (JOB_BUDGET_S: the device seconds the job may use).
# Session 18 changed the engine after both shapes' presets ran (llama8b ran
# in session 18 on 22e7c13, the 0.5B shape in session 17): the decode
# attention kernel, on by default on CUDA (worker/decode_attention.py), and
# the planner's reach (a paced pass at most twice the largest paced pass run
# so far, worker/scheduler.py); and the gateway now tokenizes a chat turn
# from where the last turn's prompt left off (gateway/serving/prompt_tokens.py:
# the warm shared-prefix turn's queue time, 4-5 ms in session 18). So: (0) bench.decode_probe on both shapes'
# dimensions (its "grouped" column: the kernel that reads a KV head once for
# all its query heads, `GROUPED`, not yet run); (1) the pacing probe on the 0.5B shape
# with the step trace (the reach's effect on a 2,000-token prompt beside 16
# streams); (2) the 0.5B shape's standard preset interleaved with both
# ceilings (the graphs-on one was the faster at C=1 there), the engine and
# mlxd, cut by a deadline; (3) the peer alone at C=32 and 64 into its own
# directory (session 18: run into the preset's directory with another
# scenario list, it replaced the preset's results.json; bench run now keeps
# the earlier file beside it). Then llama8b's preset in a later session.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
for s in qwen0.5b llama8b; do  # the grouped decode kernel's first run, beside the other
  timeout 120 python3 -m bench.decode_probe --shape $s --reps 20 --out "$R/decode-$s.json" > "$R/decode-$s.txt" 2>&1
  step decode-$s $?
done
timeout 100 python3 -m bench.pacing_probe --fused on --streams 16 --prompt 2000 --long-tokens 64 --after 4 --repeat 3 --calibrated-only --shape qwen0.5b --trace "$R/trace" --out "$R/pacing.json" > "$R/pacing.txt" 2>&1
step pacing $?
PEER=200  # the peer's two levels after the preset
TAIL=120  # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - PEER)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --interleave --step-trace --targets ceiling,ceiling_alt,engine,mlxd --deadline-s $(($(left) - PEER - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-4 $?
if [ "$(left)" -gt 80 ]; then
  timeout $(($(left) - 10)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets peer --scenarios sweep_c32,sweep_c64 --out "$R/peer" > "$R/peer.log" 2>&1
  step peer $?
fi
echo DONE >> "$R/steps"
