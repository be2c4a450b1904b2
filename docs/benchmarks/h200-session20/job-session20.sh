#!/bin/bash
# For the next GPU session (JOB_BUDGET_S: the device seconds the job may use).
# Session 19 had 268 device-seconds: only the decode probes (the grouped
# kernel won and is now the only one) and the 0.5B pacing probe ran; no
# preset. Session 18's llama8b step trace put a cold 2,016-token prompt at
# 34 ms for its first 1,024 tokens and 73.5 ms for the other 991 over them
# (a whole 2,000-token pass of the model's own: 73 ms), and a warm 73-token
# turn over 2,016 cached at 24-36 ms (14.9 for the model's own 64 over
# 2,000): the suspect is the prompt chunk's attention, MLX's unfused path
# (cuDNN's is off by default since session 4, when every new prompt length
# built a cuDNN plan; prompt attention now runs at padded lengths, so plans
# would recur). So: (1) the pass probe's engine rows with cuDNN's attention
# off and on (each pass's first use too: the plan cost); (2) the prefix
# probe with the benchmark's kind of turn (`--reply-as other`) off and on,
# and the pacing probe with it on (session 18's is the off run); (3) mlxd
# alone with it off and on under the scenarios it touches; (4) the llama8b
# standard preset
# interleaved on the engine as it now stands (the grouped decode kernel,
# the planner's reach), cut by a deadline; (5) the peer alone if time is left.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
# Runs "NAME SECONDS command..." if SECONDS are left, else records the skip.
try() {
  local name=$1 need=$2
  shift 2
  if [ "$(left)" -gt "$need" ]; then
    timeout "$need" "$@"
    step "$name" $?
  else
    step "$name-skipped" 0
  fi
}
for c in 0 1; do
  MLX_CUDA_USE_CUDNN_SDPA=$c try pass-cudnn$c 150 python3 -m bench.pass_probe --shape llama8b --reps 5 --out "$R/pass-cudnn$c.json" > "$R/pass-cudnn$c.txt" 2>&1
done
# The benchmark's own turns (the reply comes back as other tokens): session
# 18's mlxd took 24-36 ms a warm step for them, this probe 15-25 for its own.
for c in 0 1; do
  MLX_CUDA_USE_CUDNN_SDPA=$c try prefix-other-cudnn$c 90 python3 -m bench.prefix_probe --shape llama8b --conversations 2 --sync --reply-as other --out "$R/prefix-other-cudnn$c.json" > "$R/prefix-other-cudnn$c.txt" 2>&1
done
MLX_CUDA_USE_CUDNN_SDPA=1 try pacing-cudnn1 100 python3 -m bench.pacing_probe --fused on --streams 16 --prompt 2000 --long-tokens 64 --after 4 --repeat 3 --calibrated-only --shape llama8b --trace "$R/trace-cudnn1" --out "$R/pacing-cudnn1.json" > "$R/pacing-cudnn1.txt" 2>&1
# mlxd alone (so with the default memory budget, not an interleaved run's
# share of the GPU) with cuDNN's attention off, then on: off against session
# 18's interleaved mlxd says what the share costs (its cold 2,016-token
# prompt took 107 ms of passes where the in-process probe took 75), on
# against off what cuDNN does. Its worker inherits the benchmark's
# environment (bench/servers.py), less MLXD_*.
for c in 0 1; do
  MLX_CUDA_USE_CUDNN_SDPA=$c try mlxd-cudnn$c 200 python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --step-trace --scenarios long_prefill,mixed_pressure,shared_prefix --out "$R/cudnn$c" > "$R/cudnn$c.log" 2>&1
done
preset_and_peer llama8b ceiling_alt,engine,mlxd sweep,long_prefill,mixed_pressure,cancel_prefill,cancel_decode,shared_prefix
echo DONE >> "$R/steps"
