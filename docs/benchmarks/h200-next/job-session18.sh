#!/bin/bash
# For the next GPU session (JOB_BUDGET_S: the device seconds the job may use).
# Session 17 padded every pass's rows on CUDA (measured: a paced 2,000-token
# prompt's first arrival on llama8b 2.7x idle TTFT against 4.9x), then padded
# a prompt chunk's attention too and warmed those shapes (not measured on the
# GPU). And the planner put a whole 2,000-token prompt into one paced step
# of 55 ms on llama8b (15 ms steady). So: (1) the pacing probe, padding off
# against on, with the worker's step trace (each step's prediction beside its
# time; `python -c "import json; ..."` over the JSON's `trace`); (2) the
# standard preset on llama8b interleaved with three 8B targets at most (four
# ran out of device memory at C=64 in session 16; the graphs-off ceiling was
# the faster one at every level there), the engine target included; (3) the
# peer alone at C=32 and 64 for mlxd/peer, if time is left.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
P="python3 -m bench.pacing_probe --fused on --streams 16 --prompt 2000 --long-tokens 64 --after 4 --repeat 3 --calibrated-only"
for pad in off on; do
  timeout 100 $P --shape llama8b --pad-rows $pad --trace "$R/trace-$pad" --out "$R/pad-l-$pad.json" > "$R/pad-l-$pad.txt" 2>&1
  step pad-l-$pad $?
done
PEER=240  # the peer's two levels after the preset
TAIL=150  # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - PEER)) python3 -m bench run --preset standard --shape llama8b --quiet --interleave --step-trace --targets ceiling_alt,engine,mlxd --scenarios sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix --deadline-s $(($(left) - PEER - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-3 $?
if [ "$(left)" -gt 100 ]; then
  timeout $(($(left) - 10)) python3 -m bench run --preset standard --shape llama8b --quiet --targets peer --scenarios sweep_c32,sweep_c64 --out "$R/std" > "$R/peer.log" 2>&1
  step peer $?
fi
echo DONE >> "$R/steps"
