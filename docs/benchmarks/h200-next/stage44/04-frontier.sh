# Stage 4: the 0.5B shape's pacing frontier at session 42's defaults. A
# 256-token fused step cost about what a 512-token one did (7.6-8.0 against
# 8.1 ms, session 42), so fewer, larger chunks may cost the streams little.
# The planner's budget (a decode step's p90, widened to 1.25x the smallest
# chunk's cost, worker/scheduler.py) against two wider ones: `wide` (2x the
# smallest chunk's cost, chunk sizes between 512 and 1,024 and 2,048) and
# `f3` (`pacing_factor` 3: a paced step may take three decode steps; on this
# session 43's CPU it took the long prompt's TTFT from 2.0-3.6x idle to
# 1.4-1.7x, docs/benchmarks/README.md). Stage 2's run is the first default;
# then wide-1, f3-1, default-2, wide-2, f3-2 while time is left.
mp="python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace"
wide="--mlxd-env MLXD_PACING_SLACK=2 --mlxd-env MLXD_CHUNK_BUCKETS=64,128,256,512,768,1024,1536,2048"
for run in wide-1 f3-1 default-2 wide-2 f3-2; do
  [ "$(left)" -gt 75 ] || break
  case $run in wide-*) env=$wide ;; f3-*) env="--mlxd-env MLXD_PACING_FACTOR=3" ;; *) env="" ;; esac
  timeout $(($(left) - 15)) $mp $env --out "$R/pacing-$run" > "$R/pacing-$run.log" 2>&1
  step "pacing-$run" $?
done
