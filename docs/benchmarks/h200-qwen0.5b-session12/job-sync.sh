#!/bin/bash
# Session 12's last device minutes (about 2 minutes with the model's creation):
# where a warm shared-prefix turn's 32 ms goes on the qwen0.5b shape,
# bench.prefix_probe --sync (each stage waited for on the device), then the
# same conversations without it for comparison.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
timeout 90 python3 -m bench.prefix_probe --model $M --conversations 2 --sync --out $R/prefix-sync.json > $R/prefix-sync.log 2>&1
step prefix-sync $?
timeout 60 python3 -m bench.prefix_probe --model $M --conversations 2 --out $R/prefix-plain.json > $R/prefix-plain.log 2>&1
step prefix-plain $?
echo DONE >> "$R/steps"
