# Stage 2b (session 41): `join_read` (worker/fused.py; off by default) on
# and off, mlxd alone on long_prefill and mixed pressure, a pair on each
# shape while time is left (0.5B first). A prompt that finishes in a fused
# step reports its first token in that step instead of the next one (8-11 ms
# on the 0.5B shape, 32 ms on the 8B in sessions 39-40's traces): the long
# prompt's TTFT under pressure, and what waiting for the fused pass does to
# the streams' gap.
for s in "qwen0.5b 90" "llama8b 160"; do
  set -- $s
  for v in true false; do
    [ "$(left)" -gt $(($2 + 60)) ] || break 2
    timeout "$2" python3 -m bench run --preset standard --shape "$1" --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace --mlxd-env MLXD_JOIN_READ=$v --out "$R/join-$v-$1" > "$R/join-$v-$1.log" 2>&1
    step "join-$v-$1" $?
  done
done
