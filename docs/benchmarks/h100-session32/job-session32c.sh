#!/bin/bash
# After job-session32b.sh (same H100 kind): worker/kernel_warm.py's pieces
# revised (top_p's filter alone, mlx-lm's modules loaded without its package
# import). Each start on an empty kernel cache of its own, the helpers on,
# then that cache again (its marker: nothing spawned), then the helpers off.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
start() {  # start NAME PTXDIR KERNEL_WARM
  [ "$(left)" -gt 100 ] || return
  MLX_PTX_CACHE_DIR=$2 timeout 200 python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill --mlxd-env MLXD_KERNEL_WARM=$3 --out "$R/$1" > "$R/$1.log" 2>&1
  step "$1" $?
  find "$2" -name '*.ptx' -printf '%TT %s %P\n' 2>/dev/null | sort > "$R/$1-ptx.txt"
}
start warm-on ~/ptx-on true
start warm-on-again ~/ptx-on true
start warm-off ~/ptx-off false
echo DONE >> "$R/steps"
