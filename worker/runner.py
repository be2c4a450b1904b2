"""The only module that calls mlx-lm: model loading, the BatchGenerator, samplers.

Threading: everything here belongs to the engine thread. mlx-lm's BatchGenerator,
its caches and MLX's default stream are not safe for concurrent mutation, so one
thread creates a `Runner` and is the only one that ever calls it.

`Runner.step()` wraps one `BatchGenerator.next()` and turns its responses into
plain Python events with a single host transfer per step (token ids, and the
chosen/top log-probabilities of the requests that asked for them).

Containment: BatchGenerator calls every row's logits processors (and a seeded
row's own sampler) inside one `next()`, so one row's exception would fail the
whole batch. Each per-request callable is wrapped in a `_RowGuard` that turns
an exception, or a constraint that reports `failed`, into a note against its
row; `step()` hands the notes out in `StepResult.failed` and the core retires
those rows with an error while the others continue. Samplers shared by several
rows are mlx-lm's own code with validated parameters and are not wrapped (a
wrapper per row would split the batch's single sampling call).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)
from mlx_lm.utils import load as mlx_load

from protocol.messages import SamplingParams
from protocol.worker_config import DEFAULTS
from worker import batch_padding, decode_attention, decode_rotary
from worker.constraints import Constraints
from worker.fused import FusedGenerator, chunk_attention, padded_sizes, projections

Sampler = Callable[[mx.array], mx.array]
log = logging.getLogger("mlxd.worker.runner")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the worker reports about its model in the Ready handshake."""

    path: str
    identity: str
    context_length: int
    kv_bytes_per_token: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    weights_bytes: int
    load_time_s: float


@dataclass(slots=True)
class TokenEvent:
    """One generated token of one sequence, as a plain Python value."""

    uid: int
    token: int
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: list[list[float]] | None = None
    # On finish: the sequence's KV state and the tokens it covers (prefix cache).
    cache: list[Any] | None = None
    all_tokens: list[int] | None = None


@dataclass(slots=True)
class StepResult:
    tokens: list[TokenEvent] = field(default_factory=list)
    prompt_tokens: int = 0  # prompt tokens processed in this step
    prefill_done: list[int] = field(default_factory=list)  # uids whose prompt finished
    scratch_bytes: int = 0  # peak memory during the step above what was active before
    failed: dict[int, str] = field(default_factory=dict)  # uid -> why its row must retire
    # The step also built the pass over tokens an idle step had already reported
    # (worker/fused.py, idle_read): two passes, not a steady step's cost.
    settled: bool = False


class _RowGuard:
    """One row's fault note: wraps its processors and seeded sampler (module docstring)."""

    __slots__ = ("error", "uid")

    def __init__(self) -> None:
        self.uid = -1  # set once the generator assigns the row
        self.error = ""

    def note(self, error: str) -> None:
        if not self.error:
            self.error = error[:500]

    def processor(self, fn: Callable[..., mx.array]) -> Callable[..., mx.array]:
        def guarded(context: mx.array, logits: mx.array) -> mx.array:
            if self.error:
                return logits  # the row retires after this step; keep the batch's shapes
            try:
                out = fn(context, logits)
            except Exception as e:
                self.note(f"logits processor failed: {type(e).__name__}: {e}")
                return logits
            failed = getattr(fn, "failed", "")
            if failed:  # a constraint that cannot continue (worker/constraints.py)
                self.note(f"structured output failed: {failed}")
            return out

        return guarded

    def sampler(self, fn: Sampler) -> Sampler:
        def guarded(logprobs: mx.array) -> mx.array:
            try:
                return fn(logprobs)
            except Exception as e:
                self.note(f"sampler failed: {type(e).__name__}: {e}")
                return mx.argmax(logprobs, axis=-1)

        return guarded


def backend_name() -> str:
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "cpu"


def model_identity(path: Path) -> str:
    """A stable hash of what determines the model's outputs.

    Hashes the config, tokenizer files and each safetensors header (names,
    dtypes, shapes, offsets) rather than every weight byte, so it stays cheap
    for multi-GB models while still changing when the weights file changes.
    """
    h = hashlib.sha256()
    for name in sorted(p.name for p in path.iterdir()):
        file = path / name
        if name.endswith(".json") or name.endswith(".jinja"):
            h.update(name.encode())
            h.update(file.read_bytes())
        elif name.endswith(".safetensors"):
            h.update(name.encode())
            with file.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                h.update(f.read(min(header_len, 1 << 26)))
            h.update(str(file.stat().st_size).encode())
    return h.hexdigest()[:16]


def _kv_bytes_per_token(model: Any) -> int:
    """Measure KV-cache bytes per token by running one token through a fresh cache."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    total = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        values = getattr(c, "values", None)
        if keys is None or values is None:
            continue
        # (batch, kv_heads, allocated_len, head_dim): one token is heads*dim.
        for arr in (keys, values):
            total += arr.shape[1] * arr.shape[3] * arr.dtype.size
    return total


@functools.lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, top_k: int, min_p: float) -> Sampler:
    # One object per distinct setting: BatchGenerator samples all rows in one
    # call only when they share the same sampler object.
    return make_sampler(temp=temperature, top_p=top_p, top_k=top_k, min_p=min_p)


def _seeded_sampler(params: SamplingParams) -> Sampler:
    """A sampler whose n-th draw uses a key derived from (seed, n) only.

    The global mx.random state is shared by every row of the batch, so a seeded
    request must not touch it: its output would depend on its neighbours.
    """
    assert params.seed is not None
    seed = params.seed
    position = 0

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal position
        x = logprobs
        if 0 < params.top_p < 1.0:
            x = apply_top_p(x, params.top_p)
        if params.min_p:
            x = apply_min_p(x, params.min_p)
        if params.top_k > 0:
            x = apply_top_k(x, params.top_k)
        key = mx.random.key(hash((seed, position)) & 0xFFFF_FFFF_FFFF)
        position += 1
        return mx.random.categorical(x * (1.0 / params.temperature), key=key)

    return sample


def make_request_sampler(params: SamplingParams) -> Sampler | None:
    """None means the generator's shared greedy sampler."""
    if params.temperature <= 0.0:
        return None
    if params.seed is not None:
        return _seeded_sampler(params)
    return _shared_sampler(params.temperature, params.top_p, params.top_k, params.min_p)


def make_request_processors(params: SamplingParams) -> list[Callable[..., mx.array]]:
    bias = {int(k): float(v) for k, v in params.logit_bias.items()} or None
    return make_logits_processors(
        logit_bias=bias,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )


_release_buffer_cache = mx.clear_cache


def _keep_buffer_cache() -> None:
    """Stands in for mx.clear_cache inside mlx-lm (see Runner.__init__)."""


def _guard_mlx_lm() -> None:
    """Guards for mlx-lm's costs. Its prompt processing calls mx.clear_cache()
    after every prefill chunk. That returns every cached buffer to the
    allocator, so the next step re-allocates them all; on CUDA a paced chunk
    then cost ~80 ms instead of ~1 ms. This process keeps MLX's buffer cache
    (MLX bounds it by its cache limit) and releases it when the batch goes
    idle (Runner.release_buffers). Others: padding read back per layer, joins
    that copy twice (worker/batch_padding.py)."""
    mx.clear_cache = _keep_buffer_cache
    batch_padding.install()


def _use_decode_kernel(wanted: bool, model: Any, rotary: bool = False) -> bool:
    """Put worker/decode_attention.py's kernel in place if `wanted`, this is
    CUDA and it passes its check at `model`'s shape and dtype; otherwise take
    it out, so an earlier runner in this process leaves nothing on; with it,
    worker/decode_rotary.py's kernel if `rotary`. Whether it is in place."""
    decode_rotary.disable()  # an earlier runner's, whatever this one takes
    if wanted and not decode_attention.available():
        log.warning("decode_attention ragged needs MLX's CUDA backend: mlx-lm's used")
    elif wanted:
        case = decode_attention.model_case(model)
        ok = (
            decode_attention.works(case)
            if case is not None and case[1] in decode_attention.HEAD_DIMS
            else decode_attention.works()
        )
        if ok:
            log.info("decode attention: the ragged kernel in %d places", decode_attention.install())
            # the decode rows' rotation follows it where asked (worker/decode_rotary.py)
            on = rotary and decode_rotary.enable(model)
            log.info("decode rotary: the kernel %s", "on" if on else "off")
            return True
    decode_attention.uninstall()
    return False


def _load(model_path: Path, group: Any) -> tuple[Any, Any, dict[str, Any], float]:
    """The model, its tokenizer and config, and the seconds the load took.
    With a group, loaded lazily and sharded before evaluating, so each rank
    only ever materialises its own 1/N of the weights."""
    start = time.perf_counter()
    model, tokenizer, config = mlx_load(  # type: ignore[misc]
        str(model_path), return_config=True, lazy=group is not None
    )
    if group is not None and group.size() > 1:
        if not hasattr(model, "shard"):
            raise ValueError(f"{config.get('model_type')} models cannot be sharded")
        model.shard(group)
    mx.eval(model.parameters())
    return model, tokenizer, config, time.perf_counter() - start


class Runner:
    """A loaded model and the BatchGenerator that drives it."""

    def __init__(
        self,
        model_path: Path,
        *,
        max_batch: int = DEFAULTS.max_batch,
        prefill_batch: int = DEFAULTS.prefill_batch,
        prefill_chunk: int = DEFAULTS.prefill_chunk,
        group: Any = None,
        fused: bool = False,
        idle_read: bool = DEFAULTS.idle_read,
        join_read: bool = DEFAULTS.join_read,
        pad_rows: bool = False,
        ragged_decode: bool = False,
        decode_rotary: bool = DEFAULTS.decode_rotary,
        join_projections: bool = True,
        decode_rows: bool = False,
    ) -> None:
        _guard_mlx_lm()
        model, tokenizer, config, load_time = _load(model_path, group)
        self.model = model
        self.ragged_decode = _use_decode_kernel(ragged_decode, model, decode_rotary)
        eos = tuple(sorted(int(t) for t in tokenizer.eos_token_ids))
        # Grammar masks and thinking budgets (worker/constraints.py).
        self.constraints = Constraints(
            tokenizer._tokenizer, int(config.get("vocab_size") or 0), eos
        )
        self.default_stops = [[t] for t in eos]
        t = time.perf_counter()
        identity = model_identity(model_path)
        t_identity = time.perf_counter() - t
        t = time.perf_counter()
        # The model's first forward pass: on CUDA it compiles every kernel the
        # pass uses unless MLX's on-disk kernel cache has them (minutes when cold).
        kv_bytes = _kv_bytes_per_token(model)
        t_first = time.perf_counter() - t
        log.info(
            "runner: load %.2fs, identity %.2fs, first forward pass %.2fs",
            load_time,
            t_identity,
            t_first,
        )
        self.info = ModelInfo(
            path=str(model_path),
            identity=identity,
            context_length=int(config.get("max_position_embeddings") or 4096),
            kv_bytes_per_token=kv_bytes,
            eos_token_ids=eos,
            vocab_size=int(config.get("vocab_size") or 0),
            weights_bytes=int(mx.get_active_memory()),
            load_time_s=load_time,
        )
        self.max_batch = max_batch
        # mlx-lm's BatchGenerator, fused and padded as configured (worker/fused.py).
        self.generator = FusedGenerator(
            model,
            fuse=fused,
            idle_read=idle_read,
            join_read=join_read,
            pad_rows=pad_rows,
            join=join_projections,
            rows=decode_rows,
            stop_tokens=self.default_stops,
            completion_batch_size=max_batch,
            prefill_batch_size=prefill_batch,
            prefill_step_size=prefill_chunk,
        )
        if self.generator.joined:
            # the projections' own buffers, now views of the joined weights
            # (worker/joined.py), went to MLX's buffer cache: give them back
            _release_buffer_cache()
        self._wants_logprobs: dict[int, int] = {}  # uid -> top_logprobs (0 = chosen only)
        self._guards: dict[int, _RowGuard] = {}  # uid -> its fault note (module docstring)
        self._prompt_tokens_seen = 0
        self.peak_bytes = int(mx.get_peak_memory())

    @property
    def fused(self) -> bool:
        """Whether steps carry decode rows and a prompt chunk in one pass."""
        return self.generator.fuse

    @property
    def fused_steps(self) -> int:
        """Steps so far whose one pass carried decode rows and a prompt chunk."""
        return self.generator.fused_steps

    @property
    def pad_rows(self) -> bool:
        """Whether passes are padded to `pass_rows` sizes (worker/fused.py)."""
        return bool(self.generator.pad_rows)

    def warm_shapes(self) -> int:
        """Run one layer's projections and the vocabulary projection once at
        every row count steady operation can meet, so no user's step pays
        a first use (worker/fused.py, `pad_rows`): the decode batch's sizes up
        to `max_batch` and the padded passes' sizes up to a chunk beside a
        full decode batch; then a one-row chunk's attention at each padded
        chunk length up to a whole chunk and each key length the cache's
        buffer takes up to 4,096 (padded, a key length is a multiple of 256,
        which MLX hands to cuBLAS: an unwarmed one cost 4-8 ms on the 8B
        shape). Returns how many shapes it ran (0 without padding)."""
        if not self.pad_rows:
            return 0
        return self._warm_rows() + self._warm_attention()

    def _warm_rows(self) -> int:
        # Bigger passes (several full-chunk prompts at once) come from an idle
        # burst, whose pass costs far more than a first use; not warmed.
        sizes = set(range(1, self.max_batch + 1))
        sizes |= set(padded_sizes(self.prefill_chunk + self.max_batch))
        for n in sorted(sizes):
            # the rows whose logits a step computes: a decode batch's at most
            mx.eval(projections(self.model, n, logits=n <= self.max_batch))
        mx.synchronize()
        return len(sizes)

    def _warm_attention(self) -> int:
        longest = min(self.info.context_length, 4096)
        shapes = [
            (chunk, keys)
            for chunk in padded_sizes(self.prefill_chunk)
            for keys in range(256, longest + 1, 256)
            if keys >= chunk
        ]
        for chunk, keys in shapes:
            mx.eval(chunk_attention(self.model, chunk, keys))
        mx.synchronize()
        return len(shapes)

    @property
    def timed_passes(self) -> bool:
        """Whether each step waits for its own prompt pass (worker/fused.py)."""
        return bool(self.generator.timed_passes)

    @timed_passes.setter
    def timed_passes(self, on: bool) -> None:
        self.generator.timed_passes = on

    @property
    def held_back_tokens(self) -> int:
        """Prompt tokens no prompt pass covers: mlx-lm's pass of its own over the
        last one, unless the first token comes from the prompt's own pass
        (worker/fused.py, chunk_start)."""
        return 0 if self.generator.chunk_start else 1

    @property
    def prefill_chunk(self) -> int:
        return int(self.generator.prefill_step_size)

    @prefill_chunk.setter
    def prefill_chunk(self, n: int) -> None:
        # BatchGenerator reads this at every next() when it cuts prompt chunks.
        self.generator.prefill_step_size = n
        self.generator._prompt_batch.prefill_step_size = n

    def insert(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: SamplingParams,
        stop_token_ids: Sequence[int] = (),
        logprobs: bool = False,
        top_logprobs: int = 0,
        cache: list[Any] | None = None,
        cached_tokens: Sequence[int] = (),
        constraint: Callable[..., mx.array] | None = None,
    ) -> int:
        stops = None
        if stop_token_ids:
            stops = [StopSequences(self.default_stops + [[int(t)] for t in stop_token_ids])]
        guard = _RowGuard()
        processors = make_request_processors(params)
        if constraint is not None:
            processors = [*processors, constraint]  # the mask last: penalties cannot undo it
        processors = [guard.processor(p) for p in processors]
        sampler = make_request_sampler(params)
        if params.seed is not None and sampler is not None:
            sampler = guard.sampler(sampler)  # a seeded sampler is this row's own object
        (uid,) = self.generator.insert(
            [list(prompt)],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[list(cached_tokens)] if cache is not None else None,
            samplers=[sampler],  # type: ignore[list-item]
            logits_processors=[processors] if processors else None,
            stop_sequences=stops,
        )
        guard.uid = int(uid)
        if processors or params.seed is not None:
            self._guards[guard.uid] = guard
        if logprobs:
            self._wants_logprobs[uid] = top_logprobs
        return int(uid)

    def remove(
        self, uids: Sequence[int], keep_caches: bool = False
    ) -> dict[int, tuple[list[Any], list[int]]]:
        """Drop sequences; with keep_caches, return their KV state and covered tokens."""
        caches: dict[int, tuple[list[Any], list[int]]] = {}
        if uids:
            caches = self.generator.remove(list(uids), return_prompt_caches=keep_caches)
        for uid in uids:
            self._wants_logprobs.pop(uid, None)
            self._guards.pop(uid, None)
        return caches

    def drop_all(self) -> int:
        """Forget every row and give MLX's cached buffers back (after a step that
        ran out of memory, worker/core.py): the rows' state is dropped unread,
        and the device gets back what the failed step had cached. Returns the
        most MLX held during that step: its peak (step() reset it at its start)
        and its buffer cache."""
        held = int(mx.get_peak_memory()) + int(mx.get_cache_memory())
        self.generator.drop_all()
        self._wants_logprobs.clear()
        self._guards.clear()
        self._prompt_tokens_seen = int(self.generator._counters.prompt_tokens)
        batch_padding.take_ahead()
        gc.collect()  # a failed graph's arrays may sit in reference cycles
        _release_buffer_cache()
        return held

    def step(self) -> StepResult:
        active_before = mx.get_active_memory()
        mx.reset_peak_memory()
        batch_padding.take_ahead()
        settled = self.generator.settling
        prompt_responses, gen_responses = self.generator.next()
        # KV grown ahead for a prompt (batch_padding.reserve) is live state, not scratch.
        scratch = int(mx.get_peak_memory()) - active_before - batch_padding.take_ahead()
        result = StepResult(scratch_bytes=max(0, scratch), settled=settled)
        self.peak_bytes = max(self.peak_bytes, int(mx.get_peak_memory()))
        for p in prompt_responses:
            if p.end_of_prompt:
                result.prefill_done.append(int(p.uid))
        # progress is (processed, total) per prompt; sum what moved this step.
        total = int(self.generator._counters.prompt_tokens)
        result.prompt_tokens, self._prompt_tokens_seen = total - self._prompt_tokens_seen, total
        if self._guards:
            result.failed = {u: g.error for u, g in self._guards.items() if g.error}
        if not gen_responses:
            return result
        events = [
            TokenEvent(
                int(r.uid),
                int(r.token),
                r.finish_reason,
                cache=r.prompt_cache,
                all_tokens=r.all_tokens,
            )
            for r in gen_responses
        ]
        if self._wants_logprobs:
            self._attach_logprobs(gen_responses, events)
        for e in events:
            if e.finish_reason is not None:
                self._wants_logprobs.pop(e.uid, None)
                self._guards.pop(e.uid, None)
        result.tokens = events
        return result

    def _attach_logprobs(self, responses: list[Any], events: list[TokenEvent]) -> None:
        """Chosen and top-k log-probabilities for all requests that asked, in one transfer."""
        picks = [i for i, r in enumerate(responses) if int(r.uid) in self._wants_logprobs]
        if not picks:
            return
        rows = mx.stack([responses[i].logprobs for i in picks]).astype(mx.float32)
        chosen_ids = mx.array([events[i].token for i in picks])
        chosen = mx.take_along_axis(rows, chosen_ids[:, None], axis=-1)[:, 0]
        k = max(self._wants_logprobs[events[i].uid] for i in picks)
        ids_l: list[list[int]] | None = None
        vals_l: list[list[float]] | None = None
        if k > 0:
            # argpartition then sort only k entries: a full-vocab sort is far dearer.
            part = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
            part_vals = mx.take_along_axis(rows, part, axis=-1)
            order = mx.argsort(-part_vals, axis=-1)
            top_ids = mx.take_along_axis(part, order, axis=-1)
            top_vals = mx.take_along_axis(part_vals, order, axis=-1)
            ids_l = cast(list[list[int]], top_ids.tolist())
            vals_l = cast(list[list[float]], top_vals.tolist())
        chosen_l = cast(list[float], chosen.tolist())
        for j, i in enumerate(picks):
            ev = events[i]
            ev.logprob = float(chosen_l[j])
            want = self._wants_logprobs[ev.uid]
            if want and ids_l is not None and vals_l is not None:
                ev.top_logprobs = [
                    [float(t), float(v)]
                    for t, v in zip(ids_l[j][:want], vals_l[j][:want], strict=True)
                ]

    def release_buffers(self) -> None:
        """Return MLX's cached buffers to the system (call when the batch is idle).

        Synchronises first: the generator evaluates one step ahead, and buffers
        freed by that work would otherwise land in the cache after the release.
        """
        mx.synchronize()
        _release_buffer_cache()

    @property
    def live_bytes(self) -> int:
        """KV bytes held by every sequence in the batch."""
        return int(self.generator.prompt_cache_nbytes)

    @property
    def active(self) -> int:
        g = self.generator
        return len(g._generation_batch) + len(g._prompt_batch) + len(g._unprocessed_sequences)

    @property
    def decoding(self) -> int:
        return len(self.generator._generation_batch)

    def close(self) -> None:
        self.generator.close()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return cast(Callable[[int], int], fn)


# glibc mallopt parameter: the size from which malloc serves a block with its own mmap.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at its 128 KiB default (glibc only; call at start).

    glibc raises the threshold each time a mmapped block is freed, up to 32 MiB,
    so after a while the worker's variously sized buffers (MLX's CPU arrays: KV
    caches, logits, prompt chunks) come from the heap instead, where freed
    blocks fragment it and RSS creeps: 9 MiB per 1,000 requests of 8-400 prompt
    tokens over the socket, against 3.5 with the threshold pinned. Blocks of
    128 KiB and more then go back to the system when freed (MLX's buffer cache
    still keeps the ones it reuses).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def trim_malloc() -> bool:
    """Give the C allocator's free pages back to the system (glibc only).

    Returns whether anything was released.
    """
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


def cap_memory(limit_bytes: int) -> None:
    """MLX's memory limit for this process (worker/backend.py says why): past it
    an allocation first returns MLX's cached buffers to the device."""
    mx.set_memory_limit(int(limit_bytes))


def memory_stats() -> dict[str, int]:
    return {
        "active_bytes": int(mx.get_active_memory()),
        "cache_bytes": int(mx.get_cache_memory()),
    }


def device_memory_bytes() -> int | None:
    """The accelerator's usable memory, when MLX reports one (Metal, CUDA)."""
    try:
        info = mx.device_info()
    except Exception:
        return None
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return None
