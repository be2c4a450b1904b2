#!/bin/bash
# For the next GPU session (JOB_BUDGET_S about 1,300; an H200 if one comes),
# on the engine as it stands (admission_cost on since session 32,
# host_padding on since session 33):
# 1. The 0.5B standard preset whole, every ceiling, the engine and mlxd
#    interleaved: no GPU sweep has run with either setting on.
# 2. bench.admit_probe on llama8b with every paced step forced to 256 tokens:
#    the admitting step against same-size steps without an admission
#    (sessions 32-33: it costs 7-10 ms more than the next paced steps, in the
#    pass itself).
# 2b. bench.prefix_probe on llama8b, synchronised, the benchmark's kind of
#    turn (`--reply-as other`): the warm turn's admitting step (73 tokens over
#    2,087 cached, 18-23 ms on session 33's H100) by stage, with
#    host_padding on (the retirement before it no longer stalls).
# 3. The kernel helpers on the 0.5B shape, on and off, each on an empty
#    kernel cache (session 32 measured llama8b only).
# 4. llama8b's latency scenarios against the stronger ceiling.
# On a budget under 950 s (a late machine) the 0.5B preset does not fit
# beside the rest: llama8b's failing targets come first (a trace of its
# shared-prefix turns through mlxd, the prefix probe, then its latency
# scenarios through mlxd alone: each of those targets compares mlxd with
# itself), and the preset waits for a longer session.
if [ "${JOB_BUDGET_S:-1380}" -lt 950 ]; then SHAPE=llama8b; else SHAPE=qwen0.5b; fi
. "$(dirname "$0")/../h200-next/common.sh"
LATENCY=long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix
if [ "$SHAPE" = llama8b ]; then
  # The warm turn through mlxd split into its stages (network, tokenize,
  # queue, worker, delivery): in-process warm turns took 15-25 ms on the
  # H200 (session 20) where mlxd's took about 28 on an H100 (session 33).
  try trace-llama8b 180 python3 -m bench trace --preset standard --shape llama8b --quiet --scenarios shared_prefix --out "$R/trace-llama8b"
  try prefix-llama8b 200 python3 -m bench.prefix_probe --shape llama8b --sync --reply-as other --out "$R/prefix-llama8b.json"
  [ "$(left)" -gt 250 ] && preset llama8b mlxd $LATENCY latency-llama8b $(($(left) - 200))
  try admit-llama8b 150 python3 -m bench.admit_probe --shape llama8b --chunk 256 --out "$R/admit-llama8b.json"
  echo DONE >> "$R/steps"
  exit 0
fi
# The preset's deadline leaves the llama8b model and the prefix probe their
# time (about 350 s with the preset's tail) on a short budget.
D=$(($(left) - 520)); [ "$D" -gt 600 ] && D=600; [ "$D" -lt 240 ] && D=240
preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std-qwen0.5b $D
M=$(timeout 600 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))")
step model-llama8b $?
try prefix-llama8b 200 python3 -m bench.prefix_probe --shape llama8b --sync --reply-as other --out "$R/prefix-llama8b.json"
try admit-llama8b 200 python3 -m bench.admit_probe --shape llama8b --chunk 256 --out "$R/admit-llama8b.json"
cold_start qwen-warm-on qwen0.5b ~/ptx-qwen-on true 90
cold_start qwen-warm-off qwen0.5b ~/ptx-qwen-off false 120
[ "$(left)" -gt 250 ] && preset llama8b ceiling_alt,mlxd $LATENCY latency-llama8b $(($(left) - 200))
echo DONE >> "$R/steps"
