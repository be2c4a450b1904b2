# Sourced by this folder's jobs: the environment gpu.md's install gives, the
# results folder ~/R, a `steps` timeline (step NAME RC), the GPU's facts, the
# job's time left (`left`: seconds until JOB_BUDGET_S after the job began;
# a lent machine's session ends on the dot, and a step killed at its limit
# leaves nothing), and the benchmark shape's model (made on first use) in $M.
set -x
T0=$(date +%s)
BUDGET=${JOB_BUDGET_S:-1380}
left() { echo $((T0 + BUDGET - $(date +%s))); }
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd "$HOME/proj" || exit 1
R=$HOME/R
mkdir -p "$R"
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2 left=$(left)s" >> "$R/steps"; }
# Runs "NAME SECONDS command..." if SECONDS are left, else records the skip.
try() {
  local name=$1 need=$2
  shift 2
  if [ "$(left)" -gt "$need" ]; then
    timeout "$need" "$@"
    step "$name" $?
  else
    step "$name-skipped" 0
  fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
# Every process's device memory every 5 s (session 13's llama8b run ran out of
# memory again with each target capped; which process grew is not known).
# `touch $R/nopoll` pauses it (drift_probe: is the poll itself the drift?).
(while sleep 5; do [ -e "$R/nopoll" ] && continue; echo "== $(date -u +%H:%M:%S)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; ps -o pid=,args= -p "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | paste -sd, -)" 2>/dev/null | cut -c1-120; done > "$R/gpu-memory.txt" 2>&1 &)
M=$(timeout 600 python3 -c "from bench.models import shape_model; print(shape_model('$SHAPE'))")
step "model-$SHAPE" $?
# Mixed pressure through mlxd alone, the fused step on and off, alternated, a
# pair at a time while a pair's time (2 x SECONDS) is left: fused_ab SHAPE SECONDS.
fused_ab() {
  local mp="python3 -m bench run --preset standard --shape $1 --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace"
  for i in 1 2; do
    [ "$(left)" -gt $((2 * $2)) ] || break
    timeout "$2" $mp --mlxd-env MLXD_FUSED_STEP=on --out "$R/fused-on-$i" > "$R/fused-on-$i.log" 2>&1
    step "fused-on-$i" $?
    timeout "$2" $mp --mlxd-env MLXD_FUSED_STEP=off --out "$R/fused-off-$i" > "$R/fused-off-$i.log" 2>&1
    step "fused-off-$i" $?
  done
}
# Mixed pressure through mlxd alone (or SCENARIOS), a worker setting on and
# off, alternated, a pair at a time while a pair's time (2 x SECONDS) is left:
# setting_ab ENV_NAME LABEL SHAPE SECONDS [SCENARIOS] (ENV_NAME e.g. MLXD_DECODE_ROWS).
setting_ab() {
  local mp="python3 -m bench run --preset standard --shape $3 --quiet --targets mlxd --scenarios ${5:-long_prefill,mixed_pressure} --step-trace"
  for i in 1 2; do
    [ "$(left)" -gt $((2 * $4)) ] || break
    for v in on off; do
      timeout "$4" $mp --mlxd-env "$1=$v" --out "$R/$2-$v-$i" > "$R/$2-$v-$i.log" 2>&1
      step "$2-$v-$i" $?
    done
  done
}
# What moves one process's decode step from wave to wave (session 14, llama8b,
# C=1: each target's per-wave median gap 6-12 ms, bimodal, weakly correlated
# across targets within a wave, so the paired ratios' spread stays +-0.07-0.24):
# mlx-lm's batch-1 decode in-process, 16 reps of 200 tokens each, (a) nothing
# else polling the GPU, (b) the GPU's clocks, power and throttle reasons
# sampled every 250 ms beside it (each rep prints its wall-clock span and CPU),
# (c) the process pinned to one core. drift_probe SHAPE.
drift_probe() {
  touch "$R/nopoll"
  MLXD_STEP_PROBE_REPS=16 timeout 150 python3 -m bench.step_probe "$1" ceiling 1 > "$R/drift-quiet.log" 2>&1
  step drift-quiet $?
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 250 > "$R/drift-smi.csv" 2>&1 &
  local smi=$!
  MLXD_STEP_PROBE_REPS=16 timeout 150 python3 -m bench.step_probe "$1" ceiling 1 > "$R/drift-sampled.log" 2>&1
  step drift-sampled $?
  kill $smi
  MLXD_STEP_PROBE_REPS=16 timeout 150 taskset -c 3 python3 -m bench.step_probe "$1" ceiling 1 > "$R/drift-pinned.log" 2>&1
  step drift-pinned $?
  rm -f "$R/nopoll"
}
# The standard preset interleaved over TARGETS (SCENARIOS, or all of the
# preset's when empty) into $R/OUT, with the worker's step trace, cut by a
# deadline SECONDS from now (then the scenario under way, the targets'
# stopping and the report): preset SHAPE TARGETS SCENARIOS OUT SECONDS.
preset() {
  local tail=150 scenarios=${3:+--scenarios $3}
  timeout $(($5 + tail)) python3 -m bench run --preset standard --shape "$1" --quiet --interleave --step-trace --targets "$2" $scenarios --deadline-s "$5" --out "$R/$4" > "$R/$4.log" 2>&1
  step "$4" $?
}
# The peer alone at C=32 and 64 in its own directory $R/OUT (into a preset's,
# another scenario list, it would set the preset's results aside): peer SHAPE OUT.
peer() {
  if [ "$(left)" -gt 100 ]; then
    timeout $(($(left) - 10)) python3 -m bench run --preset standard --shape "$1" --quiet --targets peer --scenarios sweep_c32,sweep_c64 --out "$R/$2" > "$R/$2.log" 2>&1
    step "$2" $?
  fi
}
# mlxd alone on SHAPE's long_prefill, started on the kernel cache PTXDIR (an
# empty one: a fresh machine's first start) with worker/kernel_warm.py's
# helpers on or off, then every module in that cache with its write time:
# cold_start NAME SHAPE PTXDIR true|false SECONDS.
cold_start() {
  [ "$(left)" -gt "$5" ] || return
  MLX_PTX_CACHE_DIR=$3 timeout "$5" python3 -m bench run --preset standard --shape "$2" --quiet --targets mlxd --scenarios long_prefill --mlxd-env MLXD_KERNEL_WARM=$4 --out "$R/$1" > "$R/$1.log" 2>&1
  step "$1" $?
  find "$3" -name '*.ptx' -printf '%TT %s %P\n' 2>/dev/null | sort > "$R/$1-ptx.txt"
}
# A staged job's loop (session 38): the stages in DIR (a folder of
# ~/incoming, the work tree the last poll-staged.sh call brought; a job
# seeds it with its own tree) run one after another in name order, each
# sourced in a subshell with these functions, the tree copied to ~/proj
# first, until the budget ends or a stage whose name holds "last" has run:
# run_stages DIR (e.g. docs/benchmarks/h200-next/stage39).
run_stages() {
  [ -d "$HOME/incoming" ] || cp -a "$HOME/proj" "$HOME/incoming"
  local ran=" " next f
  while [ "$(left)" -gt 40 ]; do
    next=""
    for f in "$HOME/incoming/$1"/*.sh; do
      [ -e "$f" ] || continue
      case "$ran" in *" $(basename "$f") "*) continue ;; esac
      next=$(basename "$f")
      break
    done
    if [ -z "$next" ]; then sleep 5; continue; fi
    ran="$ran$next "
    (flock 9; rm -rf "$HOME/proj.new" && cp -a "$HOME/incoming" "$HOME/proj.new") 9> "$HOME/incoming.lock"
    # bench/results (the shapes' models) stays: the tree a poll brings has
    # none, and session 42's stages made the 8B model again each time (40 s).
    [ -d "$HOME/proj/bench/results" ] && [ ! -e "$HOME/proj.new/bench/results" ] &&
      mv "$HOME/proj/bench/results" "$HOME/proj.new/bench/results"
    rm -rf "$HOME/proj" && mv "$HOME/proj.new" "$HOME/proj"
    cd "$HOME/proj" || break
    step "stage-$next-begin" 0
    ( . "$HOME/proj/$1/$next" )
    step "stage-$next" $?
    case "$next" in *last*) break ;; esac
  done
}
