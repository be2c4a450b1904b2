"""Joined projections: q, k and v as one matmul, the MLP's gate and up as another.

On the H200 a small pass is bound by what MLX spends per primitive, and a
matmul is the dearest of them: about 10 us to launch even at 64x64 (session
22, `bench.launch_probe`), where a llama8b decode step runs seven projections
a layer, 224 matmuls. `fused_hidden` (worker/fused.py) reads q, k and v from
one matmul over their weights laid end to end, and gate and up from another:
four projections a layer instead of seven, the same arithmetic (each output
column is the same dot product), and the outputs split as views. Measured
step by step inside one engine on the H200 (session 23,
`bench.variant_probe`): a llama8b decode step 12.1 ms against 14.0 through
the model's own modules, a fused step 0.87 of its cost unjoined.

Memory does not grow: the joined weight is the only buffer, and the model's
own q/k/v and gate/up modules are given views of its rows, so mlx-lm's own
forward (the CPU path, the prompt pass of `chunk_start`) computes exactly
what it did. The joined modules are plain attributes (`JOINED_QKV`,
`JOINED_GATE_UP`), not children, so they are not in `model.parameters()`
and nothing counts their weights twice. Quantized projections join the same
way (their packed weights, scales and biases are rows per output too) when
they share a group size, bit width and mode.

Weights replaced after joining (`load_weights`, an adapter) would leave the
joined copy stale; the worker never replaces them after loading.

Joined only where `fused_hidden` runs the decode passes (FusedGenerator with
`fuse`); the MLP joins only where its forward is the llama family's SwiGLU,
checked numerically on the model's own weights before it is used. Where
joined, `fused_hidden` also rotates q and k as one array (`qk_v`): one RoPE
and one copy a layer fewer (session 24; unmeasured on the GPU yet,
`bench.variant_probe --variants joined,rope` measures it).

Threading: the engine thread only; `join_projections` once, before the
first step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

JOINED_QKV = "mlxd_joined_qkv"
JOINED_GATE_UP = "mlxd_joined_gate_up"
_ARRAYS = ("weight", "scales", "biases", "bias")
_QUANT = ("group_size", "bits", "mode")
_DENSE = "mlxd_dense"
_suspended = False
_separate_rope = False
# The pass as session 38 built it, before worker/blocks.py (its `as_before`).
plain_pass = False


@contextmanager
def suspended() -> Iterator[None]:
    """Passes built inside run the three and two projections of their own
    (bench.variant_probe: joined against not, step by step in one process)."""
    global _suspended
    before, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = before


@contextmanager
def separate_rope() -> Iterator[None]:
    """Passes built inside rotate q and k apart, as before `qk_v` (bench.variant_probe)."""
    global _separate_rope
    before, _separate_rope = _separate_rope, True
    try:
        yield
    finally:
        _separate_rope = before


@dataclass(frozen=True, slots=True)
class Joined:
    """One matmul over several projections' weights; `__call__` returns each
    projection's output (views of the joined output's columns)."""

    module: nn.Module
    ends: tuple[int, ...]  # each part's last output column + 1

    def __call__(self, x: mx.array) -> list[mx.array]:
        # One Split for all the parts, not a slice each: the same views, one
        # primitive, and a third of the host's time (bench.build_probe; on a
        # GPU a decode step is bound by the host's work, session 38).
        return cast(list[mx.array], mx.split(dense(self.module)(x), list(self.ends[:-1]), axis=-1))


@dataclass(frozen=True, slots=True)
class Dense:
    """A plain Linear's forward with its weight transposed once (`dense`)."""

    weight_t: mx.array
    bias: mx.array | None

    def __call__(self, x: mx.array) -> mx.array:
        if self.bias is None:
            return x @ self.weight_t
        return mx.addmm(self.bias, x, self.weight_t)


def dense(module: Any) -> Any:
    """`module`'s forward, for a plain nn.Linear with its weight transposed
    once and the view kept on the module (a plain attribute): nn.Linear
    builds `weight.T` at every call, a graph node per projection per pass
    (worker/blocks.py). Any other module is returned as it is. The view
    shares the weight's memory; like the joined modules, it would go stale
    if the weight were replaced after loading, which the worker never does."""
    if plain_pass or type(module) is not nn.Linear:
        return module
    made: Dense | None = module.__dict__.get(_DENSE)
    if made is None:
        made = _made_dense(module)
        mx.eval(made.weight_t)  # a view: no copy, and no node in any pass
    return made


def _made_dense(module: Any) -> Dense:
    made = Dense(module["weight"].T, module.get("bias"))
    object.__setattr__(module, _DENSE, made)
    return made


def prepare_dense(model: Any) -> int:
    """Every plain Linear `fused_hidden` calls given its `dense` view now, in
    one evaluation, so no pass stops for one (on a GPU an evaluation waits
    for the work queued before it). Returns how many."""
    modules = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_joined, gate_up = getattr(attn, JOINED_QKV, None), getattr(mlp, JOINED_GATE_UP, None)
        modules += [qkv_joined.module] if qkv_joined else [attn.q_proj, attn.k_proj, attn.v_proj]
        modules += [attn.o_proj, getattr(mlp, "down_proj", None)]
        modules += [gate_up.module] if gate_up else []
    modules.append(getattr(model, "lm_head", None))
    made = [_made_dense(m) for m in modules if type(m) is nn.Linear and _DENSE not in m.__dict__]
    mx.eval([d.weight_t for d in made])
    return len(made)


def _joinable(parts: list[nn.Module]) -> bool:
    first = parts[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear):
        return False
    names = {k for k in _ARRAYS if k in first}
    for part in parts[1:]:
        if type(part) is not type(first) or {k for k in _ARRAYS if k in part} != names:
            return False
        if any(getattr(part, a, None) != getattr(first, a, None) for a in _QUANT):
            return False
        if part["weight"].shape[1:] != first["weight"].shape[1:]:
            return False
    return True


def join(parts: list[nn.Module]) -> Joined | None:
    """The parts' weights laid end to end (by output row) in one module, and
    each part given views of its rows; None where they cannot be joined.
    Lazy: the caller evaluates the joined module and the parts together."""
    if not _joinable(parts):
        return None
    joined = copy.copy(parts[0])  # the same class and settings; its arrays replaced
    rows = [int(p["weight"].shape[0]) for p in parts]
    for name in (k for k in _ARRAYS if k in parts[0]):
        whole = mx.concatenate([p[name] for p in parts], axis=0)
        joined[name] = whole
        start = 0
        for part, n in zip(parts, rows, strict=True):
            part[name] = whole[start : start + n]
            start += n
    return Joined(joined, tuple(accumulate(rows)))


def _arrays(joined: Joined, parts: list[nn.Module]) -> list[mx.array]:
    return [m[k] for m in (joined.module, *parts) for k in _ARRAYS if k in m]


def join_projections(model: Any) -> int:
    """Join every layer's q/k/v and, where its MLP is SwiGLU, gate/up
    (module docstring); returns how many joined modules the model now has.
    Idempotent."""
    count = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        count += _attach(attn, JOINED_QKV, ["q_proj", "k_proj", "v_proj"])
        count += _attach(mlp, JOINED_GATE_UP, ["gate_proj", "up_proj"], _same_mlp)
    return count


def _attach(
    owner: Any,
    attr: str,
    names: list[str],
    check: Callable[[Any, Joined], bool] | None = None,
) -> bool:
    """`owner`'s projections `names` joined and kept as `attr` (where they
    join and `check` passes); whether `owner` has them joined."""
    if getattr(owner, attr, None) is None and all(hasattr(owner, n) for n in names):
        parts = [getattr(owner, n) for n in names]
        joined = join(parts)
        if joined is not None:
            mx.eval(_arrays(joined, parts))
            if check is None or check(owner, joined):
                setattr(owner, attr, joined)
    return getattr(owner, attr, None) is not None


def _same_mlp(mlp: Any, gate_up: Joined) -> bool:
    """Whether the MLP's own forward is SwiGLU over gate and up into
    down_proj (what `mlp` below computes), on two rows through the model's own weights. The bound
    is loose (bf16 rounding, another matmul tiling); another activation is
    off by the output's whole size."""
    if not hasattr(mlp, "down_proj"):
        return False
    gate = mlp.gate_proj
    width = int(gate["weight"].shape[1])
    if isinstance(gate, nn.QuantizedLinear):
        width = width * 32 // int(gate.bits)
    dtype = gate["scales" if "scales" in gate else "weight"].dtype
    x = mx.random.normal((2, width), key=mx.random.key(0)).astype(dtype)
    theirs, ours = mlp(x), _mlp_joined(mlp, gate_up, x)
    error = mx.max(mx.abs(theirs.astype(mx.float32) - ours.astype(mx.float32)))
    scale = mx.max(mx.abs(theirs.astype(mx.float32)))
    return bool((error <= 0.05 * scale + 1e-6).item())


def _mlp_joined(mlp: Any, gate_up: Joined, x: mx.array) -> mx.array:
    return mlp.down_proj(_swiglu(gate_up, x))


def _swiglu(gate_up: Joined, x: mx.array) -> mx.array:
    gate, up = gate_up(x)
    return cast(mx.array, swiglu(gate, up))


def mlp_inner(module: Any, x: mx.array) -> mx.array | None:
    """What the MLP's down projection takes (SwiGLU of gate and up, one
    matmul) where gate and up are joined; None where they are not."""
    joined = None if _suspended else getattr(module, JOINED_GATE_UP, None)
    return None if joined is None else _swiglu(joined, x)


def qkv(attn: Any, x: mx.array) -> list[mx.array]:
    """q, k and v of `x`: one matmul where joined, three where not."""
    joined = None if _suspended else getattr(attn, JOINED_QKV, None)
    if joined is not None:
        return joined(x)
    return [dense(attn.q_proj)(x), dense(attn.k_proj)(x), dense(attn.v_proj)(x)]


def qk_v(attn: Any, x: mx.array) -> tuple[mx.array, mx.array] | None:
    """q and k as one array (their columns side by side: the query heads,
    then the KV heads) and v, from the joined matmul; None where q and k
    cannot be rotated together (not joined, head sizes that differ, or q/k
    norms between the projection and the rotation, as qwen3 has).

    RoPE rotates every head of q and of k alike at a row's position, so one
    rotation over both is the two the model runs. On CUDA each is a kernel,
    and q and k, as column views of the joined output, are not contiguous,
    so MLX copies each before rotating it: one rotation and one copy fewer
    a layer and row group (fused_hidden)."""
    if _suspended or _separate_rope or hasattr(attn, "q_norm"):
        return None
    joined = getattr(attn, JOINED_QKV, None)
    if joined is None or len(joined.ends) != 3:
        return None
    q_end, k_end, _ = joined.ends
    if q_end * attn.n_kv_heads != (k_end - q_end) * attn.n_heads:
        return None  # a query head and a key head differ in size
    qk, v = mx.split(dense(joined.module)(x), [k_end], axis=-1)
    return qk, v


def mlp(module: Any, x: mx.array) -> mx.array:
    """The MLP of `x`: gate and up as one matmul where joined."""
    inner = mlp_inner(module, x)
    return module(x) if inner is None else module.down_proj(inner)
