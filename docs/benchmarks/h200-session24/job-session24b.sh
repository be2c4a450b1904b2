#!/bin/bash
# Session 24's second job (JOB_BUDGET_S about 650): where the two dear edge
# steps of a paced prompt go on llama8b. Through mlxd (job-session24.sh's
# mixed pressure) the step that admits the prompt cost 24 ms against 15-20
# for the next chunks, and the step in which it joins the decode rows 20-29
# ms against a 7-8 ms decode step; both fall inside its TTFT and set the
# streams' longest gap. In-process, synchronised and profiled, twice (the
# second arrival meets buffers and shapes the first left: what is gone the
# second time was a first use, an allocation say), then the same unsynchronised,
# then mlxd's mixed pressure with the slack at 2.5 on this tree (the
# prompt's KV buffer grown once: worker/batch_padding.py `reserve`).
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
probe="python3 -m bench.pacing_probe --shape llama8b --fused on --streams 16 --prompt 2000 --long-tokens 8 --after 4 --repeat 2 --chunk 512 --calibrate-s 1"
try probe-sync 240 $probe --sync --profile --trace "$R/trace-sync" --out "$R/probe-sync.json" > "$R/probe-sync.txt" 2>&1
try probe 150 $probe --trace "$R/trace" --out "$R/probe.json" > "$R/probe.txt" 2>&1
try slack2.5-reserve 100 python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace --mlxd-env MLXD_PACING_SLACK=2.5 --out "$R/slack2.5-reserve" > "$R/slack2.5-reserve.log" 2>&1
echo DONE >> "$R/steps"
