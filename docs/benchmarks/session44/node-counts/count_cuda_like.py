"""count.py with RoPE and RMSNorm stood in by one node each, as CUDA runs
them (the values are meaningless; only the graph's nodes are counted), and
worker/prompt_attention.py on or off.

    python count_cuda_like.py on|off count.py MODEL_DIR on|off OUT.json
"""

import runpy
import sys
from typing import Any

import mlx.core as mx

from worker import prompt_attention


def one_node(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    return mx.negative(x)


prompt_attention.enabled = sys.argv[1] == "on"
mx.fast.rope = one_node
mx.fast.rms_norm = one_node
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
