#!/bin/bash
# Session 24's last job (JOB_BUDGET_S about 280): is the paced prompt's
# admitting step dear because of the prefix cache? Through mlxd (llama8b,
# mixed pressure) the step that admits the long prompt cost 24-41 ms where
# the next chunks of the same or twice its size cost 19-26 and 37; in
# process, without a prefix cache (bench.pacing_probe), 22.3 against 20.2.
# mlxd's prompts share 8 template tokens with the cache, so admission merges
# a hit into the prompt batch. Mixed pressure through mlxd with the prefix
# cache off, then on, in one session; each run's step trace reads the
# admitting step beside its neighbours.
SHAPE=llama8b
. "$(dirname "$0")/common.sh"
mp="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace"
try nocache 90 $mp --mlxd-env MLXD_PREFIX_CACHE_BYTES=0 --out "$R/nocache" > "$R/nocache.log" 2>&1
try cache 90 $mp --out "$R/cache" > "$R/cache.log" 2>&1
echo DONE >> "$R/steps"
