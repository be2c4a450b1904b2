#!/bin/bash
# The final tree's kernel helpers on another shape (JOB_BUDGET_S about 180):
# qwen0.5b, mlxd alone, long_prefill, each start on an empty kernel cache of
# its own, the helpers on, then off.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
start() {  # start NAME PTXDIR KERNEL_WARM
  [ "$(left)" -gt 50 ] || return
  MLX_PTX_CACHE_DIR=$2 timeout $(($(left) - 5)) python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets mlxd --scenarios long_prefill --mlxd-env MLXD_KERNEL_WARM=$3 --out "$R/$1" > "$R/$1.log" 2>&1
  step "$1" $?
  find "$2" -name '*.ptx' -printf '%TT %s %P\n' 2>/dev/null | sort > "$R/$1-ptx.txt"
}
start qwen-warm-on ~/ptx-on true
start qwen-warm-off ~/ptx-off false
echo DONE >> "$R/steps"
