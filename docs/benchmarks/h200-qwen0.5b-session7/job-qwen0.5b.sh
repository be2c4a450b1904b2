#!/bin/bash
# Prepared in session 6 (not run: no machine was lent). The standard preset
# on qwen0.5b after the burst rule (young rows are part of the arrival), the
# arrival window, hidden torch/sklearn and 32 requests per sweep level:
# mlxd, engine, both ceilings (ceiling, ceiling_alt: the report uses the
# faster per scenario), peer; the shared-prefix probe; a start-up probe;
# mlxd again with the arrival window off (its A/B); a trace of C=4/16;
# mlxd with the fused step. About 17 minutes, 20 with the fused run.
SHAPE=qwen0.5b
# common.sh: ../h200-next/common.sh as of 8f97e7b (unchanged since).
. "$(dirname "$0")/common.sh"
python3 - > $R/startup-probe.txt 2>&1 <<'PY'
import subprocess, sys
for hide in (False, True):
    code = ("import sys, time\n"
            + ("from protocol.hidden_imports import hide_unused_frameworks; hide_unused_frameworks()\n" if hide else "")
            + "t = time.monotonic(); import mlx_lm.tokenizer_utils, mlx_lm.models.cache\n"
            "print(f'import mlx_lm {time.monotonic() - t:.2f}s; torch imported: {sys.modules.get(\"torch\") is not None}')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"hidden={hide}: {out.stdout.strip()} {out.stderr.strip()[-300:]}")
PY
step startup-probe $?
B="timeout 330 python3 -m bench run --preset standard --shape qwen0.5b --quiet"
$B --targets mlxd --out "$R/std" > "$R/mlxd.log" 2>&1
step mlxd $?
timeout 120 python3 -m bench.prefix_probe --model $M --out $R/prefix-probe.json > $R/prefix-probe.log 2>&1
step prefix-probe $?
$B --targets engine --out "$R/std" > "$R/engine.log" 2>&1
step engine $?
$B --targets ceiling,ceiling_alt --out "$R/std" > "$R/ceiling.log" 2>&1
step ceilings $?
timeout 400 python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets peer --out "$R/std" > "$R/peer.log" 2>&1
step peer $?
$B --targets mlxd --mlxd-env MLXD_ARRIVAL_WINDOW_S=0 --out "$R/window-off" > "$R/mlxd-window-off.log" 2>&1
step mlxd-window-off $?
timeout 150 python3 -m bench trace --preset standard --shape qwen0.5b --quiet --scenarios sweep_c4,sweep_c16 --out $R/trace > $R/trace.log 2>&1
step trace $?
# Last, if the session's device time allows: the fused step through mlxd (its
# only run was session 4's, before the early join and the fit fix).
$B --targets mlxd --mlxd-env MLXD_FUSED_STEP=on --out "$R/fused" > "$R/mlxd-fused.log" 2>&1
step mlxd-fused $?
echo DONE >> "$R/steps"
