#!/bin/bash
# For the GPU session after session 32's first job (JOB_BUDGET_S about 800):
# does worker/kernel_warm.py (compile MLX's kernels in helper processes beside
# the model's load) bring a fresh machine's first warm-up from 27.7 s (session
# 32, llama8b, H100) under 10 s? mlxd alone, long_prefill, each start on its
# own kernel cache: empty with the helpers off, empty with them on, then that
# one again (its marker: nothing spawned). Then bench.admit_probe on llama8b:
# which stage of the step that admits a prompt carries its excess.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
start() {  # start NAME PTXDIR KERNEL_WARM
  [ "$(left)" -gt 150 ] || return
  MLX_PTX_CACHE_DIR=$2 timeout 240 python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill --mlxd-env MLXD_KERNEL_WARM=$3 --out "$R/$1" > "$R/$1.log" 2>&1
  step "$1" $?
  find "$2" -name '*.ptx' -printf '%TT %s %P\n' 2>/dev/null | sort > "$R/$1-ptx.txt"
  ls -la "$2" > "$R/$1-ls.txt" 2>&1
}
start warm-off ~/ptx-off false
start warm-on ~/ptx-on true
start warm-on-again ~/ptx-on true
[ "$(left)" -gt 200 ] && { timeout $(($(left) - 30)) python3 -m bench.admit_probe --shape llama8b --out "$R/admit-llama8b.json" > "$R/admit-llama8b.log" 2>&1; step admit-llama8b $?; }
echo DONE >> "$R/steps"
