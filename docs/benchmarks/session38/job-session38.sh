#!/bin/bash
# Session 38's job: session 36's third job's diagnostics of the step a long
# prompt joins in (session 36's job-session36c.sh, whose steps these are: host arrays, the admit probe's phases
# and host passes, Nsight Systems if present), then open stages. Each poll
# call (poll38.sh) brings the session's work tree to ~/incoming; a script
# stage38/NN-*.sh there that has not run yet runs next (the tree copied to
# ~/proj first, so a stage may measure code written after the job began),
# in name order, sourced in a subshell with common.sh's functions, until the
# budget ends or a stage whose name holds "last" has run.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
try host-arrays 150 python3 -m bench.alloc_probe --shape llama8b --host-arrays --out "$R/alloc-host.json"
try admit-phases 200 python3 -m bench.admit_probe --shape llama8b --chunk 256 --prompts 2000 --reps 4 --passes default,phases,host --out "$R/admit-phases.json"
if command -v nsys > /dev/null && [ "$(left)" -gt 300 ]; then
  timeout 200 nsys profile -t cuda -o "$HOME/admit-nsys" --force-overwrite true python3 -m bench.admit_probe --shape llama8b --chunk 256 --prompts 2000 --reps 2 --passes default > "$R/nsys.log" 2>&1
  step nsys $?
  timeout 90 nsys stats --report cuda_api_sum,cuda_gpu_kern_sum --format csv "$HOME/admit-nsys.nsys-rep" > "$R/nsys-stats.csv" 2>&1
  step nsys-stats $?
else
  step nsys-absent 0
fi
step diagnostics-done 0
# The stage loop ran inline here; it is now common.sh's run_stages.
run_stages docs/benchmarks/h200-next/stage38
echo DONE >> "$R/steps"
