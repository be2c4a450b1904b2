#!/bin/bash
# For session 28 (JOB_BUDGET_S about 900-1,000 after refused starts): one
# shape's whole standard preset on the engine as it stands, which issue #12
# allows per session: the 0.5B shape interleaved with both ceilings, the
# engine and mlxd (session 24: every scenario in 419 s on a fresh machine),
# then the peer at C=32 and 64 on the same machine for mlxd/peer. llama8b's
# preset (`job-session25.sh`'s second half) is the next session's.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
deadline=$(($(left) - 330))
[ "$deadline" -gt 600 ] && deadline=600
preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std "$deadline"
peer qwen0.5b peer-qwen0.5b
echo DONE >> "$R/steps"
