# Stage 0 (session 44): worker/prompt_attention.py on CUDA, its tests and
# the pass's (worker/blocks.py) beside MLX's attention. Where they fail,
# $R/pa-off makes the later stages run mlxd with it off.
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_prompt_attention.py tests/test_blocks.py > "$R/check.log" 2>&1
rc=$?
step check $rc
[ "$rc" = 0 ] || touch "$R/pa-off"
