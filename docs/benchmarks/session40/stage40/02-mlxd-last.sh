# Stage 2 (the last): mlxd (the tree at the stage's start: session 40's pass
# from stage 1b on) on session 39's graphs-off scenarios, once on
# each shape: the build probe above says how fast this machine's host is,
# which (session 39) decides a step's time as much as the code does.
for s in "qwen0.5b long_prefill,mixed_pressure,sweep_c16,sweep_c64" "llama8b long_prefill,mixed_pressure,sweep_c16"; do
  set -- $s
  [ "$(left)" -gt 100 ] || break
  timeout $(($(left) - 20)) python3 -m bench run --preset standard --shape "$1" --quiet --targets mlxd --scenarios "$2" --step-trace --out "$R/final-$1" > "$R/final-$1.log" 2>&1
  step "final-$1" $?
done
