# Sourced by this folder's jobs: the environment gpu.md's install gives, the
# results folder ~/R, a `steps` timeline (step NAME RC), the GPU's facts, and
# the benchmark shape's model (made on first use) in $M.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$HOME/proj
cd "$HOME/proj" || exit 1
R=$HOME/R
mkdir -p "$R"
step() { echo "$1 $(date -u +%H:%M:%S) rc=$2" >> "$R/steps"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
M=$(timeout 600 python3 -c "from bench.models import shape_model; print(shape_model('$SHAPE'))")
step "model-$SHAPE" $?
