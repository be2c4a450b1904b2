#!/bin/bash
# Session 20's second job (JOB_BUDGET_S about 450). The first job's probes
# showed a prompt chunk over cached tokens slower than its size says: in
# `bench.pass_probe` 991 tokens over 1,025 cached took 59 ms, where the
# warm-up's 1,024 over 1,024 took 43, and mlxd's cold 2,000-token prompts
# paid 58-74 ms for their second chunk. mlx-lm's BatchKVCache keeps a buffer
# that is not a whole number of its 256-slot steps off that grid for good
# (a prefix-cache merge sizes it to the row; the benchmark's prompts share 8
# template tokens), and the chunk's attention runs over the whole buffer.
# Now the buffer grows on the grid (worker/batch_padding.py). After, against
# the first job's records (cuDNN's attention off, mlxd's default): (1) the
# pass probe's engine rows; (2) mlxd alone on the scenarios the first job
# ran it on; (3) the prefix probe with the benchmark's kind of turn.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
try pass 80 python3 -m bench.pass_probe --shape llama8b --reps 5 --out "$R/pass.json" > "$R/pass.txt" 2>&1
try mlxd 180 python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --step-trace --scenarios long_prefill,mixed_pressure,shared_prefix --out "$R/mlxd" > "$R/mlxd.log" 2>&1
try prefix-other 80 python3 -m bench.prefix_probe --shape llama8b --conversations 2 --sync --reply-as other --out "$R/prefix-other.json" > "$R/prefix-other.txt" 2>&1
echo DONE >> "$R/steps"
