# Session 44's node counts (docs/benchmarks/README.md): a step's primitives
# by kind, 16 rows decoding and a 1,000-token prompt in 256-token chunks,
# pad_rows on, on float32 models with the 0.5B shape's heads at 2 and 4
# layers (the per-layer figure: the 4-layer count less the 2-layer one,
# halved). counts.json: "before" at f5f8f00 (count.py); the others at
# 14519f1: "attention_and_split", count.py with prompt_attention.enabled
# set; "cuda_like_*", count_cuda_like.py (RoPE and RMSNorm one node each),
# the attention off and on, as below.
for L in 2 4; do .venv/bin/python -c "
from pathlib import Path
from worker.modelfiles.random_model import make_random_model
make_random_model(Path('/tmp/q$L'), layers=$L, hidden=896, heads=14, kv_heads=2, intermediate=256, vocab_size=4096, context_length=8192)"; done
for pa in off on; do for L in 2 4; do
  PYTHONPATH=. .venv/bin/python docs/benchmarks/session44/node-counts/count_cuda_like.py $pa docs/benchmarks/session44/node-counts/count.py /tmp/q$L on /tmp/cl-$pa-q$L.json
done; done
