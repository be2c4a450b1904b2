# Stage 1b (session 41): where the long prompt's TTFT under mixed pressure
# goes outside the worker's steps. On the 0.5B shape its chunk steps took
# 43-64 ms of an 64-85 ms TTFT (session 39 graphs-off-1, session 40), where
# the idle prompt's one 20 ms step left 9.4 ms outside: `bench trace` splits
# TTFT into network, tokenize, queue, submit, worker and delivery.
[ "$(left)" -gt 200 ] && {
  timeout 150 python3 -m bench trace --preset standard --shape qwen0.5b --scenarios long_prefill,mixed_pressure --out "$R/trace-05b" > "$R/trace-05b.log" 2>&1
  step trace-05b $?
}
