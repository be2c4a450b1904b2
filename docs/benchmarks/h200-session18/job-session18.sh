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
# Added in session 18: the warm shared-prefix turn on llama8b was 27-29 ms
# in-process (session 17, before the padding) where 5x needs about 16, and a
# one-row decode step there is about 11 ms: the pass probe (what a 64-token
# pass over 2,000 cached tokens costs beside a decode pass, synchronised) and
# the prefix probe with --sync (which stage a warm turn's time is in) on the
# padded engine; and last, if time is left, mlxd with CUDA graphs on at C=1
# and under mixed pressure (the graphs-on ceiling was 9% faster at C=1 on
# the 0.5B shape, and passes now come in few sizes).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
P="python3 -m bench.pacing_probe --fused on --streams 16 --prompt 2000 --long-tokens 64 --after 4 --repeat 3 --calibrated-only"
for pad in off on; do
  timeout 100 $P --shape llama8b --pad-rows $pad --trace "$R/trace-$pad" --out "$R/pad-l-$pad.json" > "$R/pad-l-$pad.txt" 2>&1
  step pad-l-$pad $?
done
timeout 120 python3 -m bench.pass_probe --shape llama8b --reps 6 --out "$R/pass-l.json" > "$R/pass-l.txt" 2>&1
step pass-l $?
timeout 90 python3 -m bench.prefix_probe --shape llama8b --conversations 2 --sync --out "$R/prefix-l.json" > "$R/prefix-l.txt" 2>&1
step prefix-l $?
PEER=240  # the peer's two levels after the preset
TAIL=150  # after the deadline: the scenario under way, the targets' stopping, the report
timeout $(($(left) - PEER)) python3 -m bench run --preset standard --shape llama8b --quiet --interleave --step-trace --targets ceiling_alt,engine,mlxd --scenarios sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix --deadline-s $(($(left) - PEER - TAIL)) --out "$R/std" > "$R/std.log" 2>&1
step interleaved-3 $?
if [ "$(left)" -gt 100 ]; then
  timeout $(($(left) - 10)) python3 -m bench run --preset standard --shape llama8b --quiet --targets peer --scenarios sweep_c32,sweep_c64 --out "$R/std" > "$R/peer.log" 2>&1
  step peer $?
fi
if [ "$(left)" -gt 120 ]; then
  timeout $(($(left) - 10)) python3 -m bench run --preset standard --shape llama8b --quiet --interleave --targets mlxd --mlxd-env MLXD_CUDA_GRAPHS=on --step-trace --scenarios sweep_c1,long_prefill,mixed_pressure --deadline-s $(($(left) - 60)) --out "$R/graphs-on" > "$R/graphs-on.log" 2>&1
  step graphs-on $?
fi
echo DONE >> "$R/steps"
