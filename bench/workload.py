"""The fixed, seeded workload: presets, scenarios and the exact requests they send.

This module owns *what* is sent, never *how*: every request of every scenario is
built here from (preset, seed, the model's chat template), so two runs with the
same inputs send byte-identical requests. Prompts are word salad drawn from a
built-in word list with a seeded RNG and cut to an exact token length of the
chat-templated prompt (the same template the servers apply), so the ceiling can
be fed the very token ids the servers see.

Scenarios (kind: what it measures):
- sweep (`sweep_cN`): N streaming requests sent at once, repeated `waves` times
  (at least `min_wave_requests` requests per level): TTFT, inter-token gap,
  end-to-end latency and aggregate tokens/s vs concurrency.
- nonstream: sequential non-streaming requests: end-to-end latency.
- long_prefill: sequential long prompts on an idle server: TTFT of a long prefill.
- sustained: many streams with long outputs: steady decode rate and gaps.
- shared_prefix: multi-turn chats, one at a time, on top of a long system prompt:
  cold (first turn) vs warm (history cached) TTFT, cached_tokens. Each turn
  sends the conversation so far with the target's own replies; with random
  weights (`canned_replies`) a fixed word-salad reply cut to
  `prefix_turn_tokens` tokens stands in for the target's. A random model's
  reply is mostly ids its tokenizer cannot produce from text
  (`<|reserved_N|>` pads the vocabulary to the shape's size), so sent back
  as text it re-tokenizes about 15x longer: on the qwen0.5b shape 64
  generated tokens came back as about 1,000 prompt tokens, and every warm
  turn was a 1,000-token prefill rather than a turn over its cached history.
  A real model's reply re-tokenizes to about what it generated.
- mixed: streams decode, then a long prompt arrives: the streams' gaps before vs
  during its prefill, and its TTFT vs the idle long_prefill TTFT.
- slow_readers: some streams read slowly (small receive buffer, sleeps between
  reads) beside normal streams: the normal streams must not slow down.
- cancel (`cancel_prefill`, `cancel_decode`): clients leave during prefill or
  after a few tokens while background streams decode: cancellation-to-retirement.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Renders chat messages to the prompt token ids (chat template + tokenizer).
Render = Callable[[list[dict[str, str]]], list[int]]

GENERATOR_VERSION = 1

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it his an were are which "
    "this be or has had not but first one their its new after who they have two her she "
    "been other when there all during into school time may years more most only over city "
    "some world would where later up such used many can state about national out known "
    "university united then made team group river water house music light north south east "
    "west small large early late long short great little old young high low good right left "
    "between under while since without within through each every both few several any same "
    "different important public local general special major common human social political "
    "history family system program company service number area part place point case week "
    "month year day night morning evening road street field garden forest mountain island "
    "village market station bridge tower castle church library museum theatre hospital "
    "question answer story paper letter window table chair door stone glass metal wood "
    "paint colour green blue red yellow black white brown quiet loud bright dark warm cold "
    "open closed simple careful quick slow strong gentle kind brave calm proud happy sad"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class Preset:
    """Sizes of every scenario; the names are the presets' and `test`'s."""

    name: str
    concurrency: tuple[int, ...]
    waves: int
    prompt_tokens: tuple[int, int]  # sweep/nonstream/stream prompts: min, max
    max_tokens: int  # sweep and nonstream output length
    nonstream_requests: int
    long_prompt_tokens: int  # long_prefill, mixed and cancel_prefill prompts
    long_repeats: int
    long_max_tokens: int
    sustained_streams: int
    sustained_tokens: int
    prefix_conversations: int
    prefix_turns: int
    prefix_history_tokens: int
    prefix_turn_tokens: int  # max_tokens of each chat turn
    mixed_streams: int
    mixed_tokens: int
    mixed_steady_tokens: int  # tokens each stream gets before the long prompt arrives
    slow_readers: int
    slow_fast_streams: int
    slow_tokens: int
    slow_read_delay_s: float
    cancel_prefill: int
    cancel_decode: int
    cancel_after_tokens: int
    cancel_background: int
    warmup_all_levels: bool  # warm every concurrency level (first-use compiles on GPUs)
    request_timeout_s: float = 600.0
    # Each sweep level runs at least this many requests (more waves at low
    # concurrency), so its tok/s ratios have a spread worth reading.
    min_wave_requests: int = 0

    def waves_at(self, concurrency: int) -> int:
        return max(self.waves, -(-self.min_wave_requests // concurrency))


PRESETS: dict[str, Preset] = {
    # For tests/test_bench.py: the machinery end to end in seconds.
    "test": Preset(
        name="test",
        concurrency=(1, 2),
        waves=1,
        prompt_tokens=(24, 48),
        max_tokens=8,
        nonstream_requests=2,
        long_prompt_tokens=192,
        long_repeats=1,
        long_max_tokens=4,
        sustained_streams=2,
        sustained_tokens=24,
        prefix_conversations=1,
        prefix_turns=2,
        prefix_history_tokens=192,
        prefix_turn_tokens=8,
        mixed_streams=2,
        mixed_tokens=48,
        mixed_steady_tokens=8,
        slow_readers=1,
        slow_fast_streams=1,
        slow_tokens=16,
        slow_read_delay_s=0.01,
        cancel_prefill=1,
        cancel_decode=1,
        cancel_after_tokens=2,
        cancel_background=1,
        warmup_all_levels=False,
        request_timeout_s=120.0,
    ),
    # `make bench`: under a minute on a 2-core CPU with the tiny random model.
    "smoke": Preset(
        name="smoke",
        concurrency=(1, 4, 8),
        waves=2,
        prompt_tokens=(32, 128),
        max_tokens=32,
        nonstream_requests=4,
        long_prompt_tokens=1024,
        long_repeats=2,
        long_max_tokens=8,
        sustained_streams=4,
        sustained_tokens=128,
        prefix_conversations=2,
        prefix_turns=3,
        prefix_history_tokens=1024,
        prefix_turn_tokens=16,
        mixed_streams=4,
        mixed_tokens=256,
        mixed_steady_tokens=24,
        slow_readers=2,
        slow_fast_streams=2,
        slow_tokens=64,
        slow_read_delay_s=0.02,
        cancel_prefill=3,
        cancel_decode=3,
        cancel_after_tokens=4,
        cancel_background=2,
        warmup_all_levels=False,
        request_timeout_s=120.0,
    ),
    # The GPU preset: the concurrency levels and 2000-token prompts.
    "standard": Preset(
        name="standard",
        concurrency=(1, 4, 8, 16, 32, 64),
        waves=3,
        prompt_tokens=(128, 512),
        max_tokens=128,
        nonstream_requests=16,
        long_prompt_tokens=2000,
        long_repeats=3,
        long_max_tokens=16,
        sustained_streams=16,
        sustained_tokens=512,
        prefix_conversations=4,
        prefix_turns=4,
        prefix_history_tokens=2000,
        prefix_turn_tokens=64,
        mixed_streams=16,
        mixed_tokens=768,
        mixed_steady_tokens=64,
        slow_readers=4,
        slow_fast_streams=8,
        slow_tokens=256,
        slow_read_delay_s=0.05,
        cancel_prefill=8,
        cancel_decode=8,
        cancel_after_tokens=8,
        cancel_background=4,
        warmup_all_levels=True,
        request_timeout_s=300.0,
        min_wave_requests=32,
    ),
    "long": Preset(
        name="long",
        concurrency=(1, 4, 8, 16, 32, 64),
        waves=5,
        prompt_tokens=(256, 1024),
        max_tokens=256,
        nonstream_requests=32,
        long_prompt_tokens=3000,
        long_repeats=5,
        long_max_tokens=16,
        sustained_streams=32,
        sustained_tokens=1024,
        prefix_conversations=8,
        prefix_turns=6,
        prefix_history_tokens=2000,
        prefix_turn_tokens=64,
        mixed_streams=32,
        mixed_tokens=1024,
        mixed_steady_tokens=64,
        slow_readers=8,
        slow_fast_streams=16,
        slow_tokens=512,
        slow_read_delay_s=0.05,
        cancel_prefill=16,
        cancel_decode=16,
        cancel_after_tokens=8,
        cancel_background=8,
        warmup_all_levels=True,
        request_timeout_s=600.0,
    ),
}


@dataclass(slots=True)
class RequestSpec:
    """One request: its messages, its rendered prompt ids and how the client behaves."""

    id: str
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    max_tokens: int
    stream: bool = True
    # Leave during prefill: this fraction of the target's idle long-prefill TTFT after
    # the response headers (the runner measures that TTFT first), unless a token came.
    cancel_in_prefill: float | None = None
    cancel_after_tokens: int | None = None  # leave after this many tokens
    read_delay_s: float = 0.0  # a slow reader sleeps this long between reads

    def public(self) -> dict[str, Any]:
        """What the results file keeps: everything but the (derivable) token ids."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prompt_ids"}
        d["prompt_tokens"] = len(self.prompt_ids)
        return {k: v for k, v in d.items() if v is not None}


# Scenario kinds every target runs, the in-process ones included: the ones
# whose waves `bench run --interleave` alternates between targets.
PAIRED_KINDS = ("sweep", "long_prefill", "sustained")


@dataclass(slots=True)
class Scenario:
    name: str
    kind: str
    groups: dict[str, list[RequestSpec]]
    params: dict[str, Any] = field(default_factory=dict)

    def requests(self) -> list[RequestSpec]:
        return [r for g in self.groups.values() for r in g]

    def waves(self) -> list[list[RequestSpec]]:
        """The waves of a scenario every target runs (a kind in PAIRED_KINDS), as
        each runs them: the long prompts one at a time (a lone prefill's TTFT),
        otherwise each group at once. One definition for the in-process targets
        and the servers, so `bench run --interleave` pairs the same waves."""
        if self.kind == "long_prefill":
            return [[r] for r in self.groups["requests"]]
        return [list(g) for g in self.groups.values()]


@dataclass(slots=True)
class Workload:
    preset: Preset
    seed: int
    suppress_eos: list[int]  # EOS ids given a -100 logit bias (random models never need it)
    scenarios: list[Scenario]
    warmup: list[list[RequestSpec]]  # waves sent (and discarded) before measuring

    def scenario(self, name: str) -> Scenario:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)

    def select(self, wanted: Sequence[str]) -> Workload:
        """Only the scenarios named, or of the kinds named (sizes stay the preset's)."""
        keep = [s for s in self.scenarios if s.name in wanted or s.kind in wanted]
        if not keep:
            raise SystemExit(
                f"bench: no scenario matches {', '.join(wanted)}; names: "
                f"{', '.join(s.name for s in self.scenarios)}"
            )
        return Workload(self.preset, self.seed, self.suppress_eos, keep, self.warmup)

    def max_concurrency(self) -> int:
        p = self.preset
        return max(
            *p.concurrency,
            p.sustained_streams,
            p.mixed_streams + 1,
            p.slow_readers + p.slow_fast_streams,
            p.cancel_background + 1,
        )

    def digest(self) -> str:
        """Identity of the exact requests: compare refuses runs whose digests differ."""
        h = hashlib.sha256()
        h.update(json.dumps(asdict(self.preset), sort_keys=True).encode())
        h.update(json.dumps([self.seed, self.suppress_eos, GENERATOR_VERSION]).encode())
        for s in self.scenarios:
            h.update(json.dumps([s.name, s.kind, s.params], sort_keys=True).encode())
            for gname, reqs in s.groups.items():
                h.update(gname.encode())
                for r in reqs:
                    h.update(json.dumps(r.public(), sort_keys=True).encode())
                    h.update(json.dumps(r.prompt_ids).encode())
        return h.hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {
            "preset": asdict(self.preset),
            "seed": self.seed,
            "suppress_eos": self.suppress_eos,
            "generator_version": GENERATOR_VERSION,
            "digest": self.digest(),
            "scenarios": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "params": s.params,
                    "groups": {g: [r.public() for r in reqs] for g, reqs in s.groups.items()},
                }
                for s in self.scenarios
            ],
        }


class _Prompts:
    """Seeded word-salad texts cut to an exact chat-templated token length."""

    def __init__(self, render: Render, seed: int) -> None:
        self.render = render
        self.rng = random.Random(seed)

    def words(self, n: int) -> list[str]:
        return [self.rng.choice(_WORDS) for _ in range(n)]

    def user(self, target: int) -> tuple[list[dict[str, str]], list[int]]:
        """A user message whose rendered prompt has at most `target` tokens (as close as
        whole words allow), and that prompt's token ids."""
        # Every word is at least one token, so `target` words always reach the target.
        words = self.words(target + 8)

        def build(k: int) -> list[dict[str, str]]:
            return [{"role": "user", "content": " ".join(words[:k])}]

        lo, hi = 1, len(words)
        best = build(1)
        best_ids = self.render(best)
        while lo <= hi:  # bounded: log2(2 * target) iterations
            mid = (lo + hi) // 2
            msgs = build(mid)
            ids = self.render(msgs)
            if len(ids) <= target:
                best, best_ids, lo = msgs, ids, mid + 1
            else:
                hi = mid - 1
        return best, best_ids

    def system_text(self, target: int) -> str:
        """A system prompt such that system + a one-word user turn is about `target` tokens."""
        msgs, _ = self.user(target)
        return msgs[-1]["content"]

    def length(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


def build_workload(
    preset: Preset,
    render: Render,
    *,
    seed: int = 0,
    suppress_eos: Sequence[int] = (),
    canned_replies: bool = False,
) -> Workload:
    """Every request of every scenario for this preset, from the seed alone.

    `canned_replies`: shared_prefix conversations send back fixed replies
    instead of the target's (for random weights; module docstring)."""
    p = preset
    gen = _Prompts(render, seed)
    scenarios: list[Scenario] = []

    def short(rid: str, max_tokens: int, **kw: Any) -> RequestSpec:
        msgs, ids = gen.user(gen.length(*p.prompt_tokens))
        return RequestSpec(rid, msgs, ids, max_tokens, **kw)

    def long(rid: str, max_tokens: int, **kw: Any) -> RequestSpec:
        msgs, ids = gen.user(p.long_prompt_tokens)
        return RequestSpec(rid, msgs, ids, max_tokens, **kw)

    warmup = [[short(f"warmup/c1/{i}", 4) for i in range(1)]]
    if p.warmup_all_levels:
        warmup += [[short(f"warmup/c{c}/{i}", 4) for i in range(c)] for c in p.concurrency]

    for c in p.concurrency:
        name = f"sweep_c{c}"
        groups = {
            f"wave{w}": [short(f"{name}/w{w}/{i}", p.max_tokens) for i in range(c)]
            for w in range(p.waves_at(c))
        }
        scenarios.append(Scenario(name, "sweep", groups, {"concurrency": c}))

    scenarios.append(
        Scenario(
            "nonstream",
            "nonstream",
            {
                "requests": [
                    short(f"nonstream/{i}", p.max_tokens, stream=False)
                    for i in range(p.nonstream_requests)
                ]
            },
        )
    )
    scenarios.append(
        Scenario(
            "long_prefill",
            "long_prefill",
            {
                "requests": [
                    long(f"long_prefill/{i}", p.long_max_tokens) for i in range(p.long_repeats)
                ]
            },
            {"prompt_tokens": p.long_prompt_tokens},
        )
    )
    scenarios.append(
        Scenario(
            "sustained_decode",
            "sustained",
            {
                "streams": [
                    short(f"sustained_decode/{i}", p.sustained_tokens)
                    for i in range(p.sustained_streams)
                ]
            },
        )
    )

    # Each turn holds only its new messages (turn 0: the long system prompt and the
    # first user message); the runner sends the whole conversation so far, with the
    # assistant replies the target gave, so only turn 0's prompt ids are known here.
    conversations: dict[str, list[RequestSpec]] = {}
    for c in range(p.prefix_conversations):
        system = [{"role": "system", "content": gen.system_text(p.prefix_history_tokens)}]
        turns = []
        for t in range(p.prefix_turns):
            user = gen.user(24)[0][-1]
            msgs = [*system, user] if t == 0 else [user]
            ids = render(msgs) if t == 0 else []
            turns.append(RequestSpec(f"shared_prefix/c{c}/t{t}", msgs, ids, p.prefix_turn_tokens))
        conversations[f"conversation{c}"] = turns
    prefix_params: dict[str, Any] = {"history_tokens": p.prefix_history_tokens}
    if canned_replies:
        # A generator of their own: the other scenarios' requests stay as they
        # were. Each reply is cut as a user turn of `prefix_turn_tokens` tokens
        # is: about what a model that generated that many would send back.
        replies = _Prompts(render, seed + 1)
        prefix_params["replies"] = {
            r.id: replies.user(p.prefix_turn_tokens)[0][-1]["content"]
            for turns in conversations.values()
            for r in turns
        }
    scenarios.append(Scenario("shared_prefix", "shared_prefix", conversations, prefix_params))

    scenarios.append(
        Scenario(
            "mixed_pressure",
            "mixed",
            {
                "streams": [
                    short(f"mixed_pressure/s{i}", p.mixed_tokens) for i in range(p.mixed_streams)
                ],
                "long": [long("mixed_pressure/long", p.long_max_tokens)],
            },
            {"steady_tokens": p.mixed_steady_tokens, "prompt_tokens": p.long_prompt_tokens},
        )
    )
    scenarios.append(
        Scenario(
            "slow_readers",
            "slow_readers",
            {
                "slow": [
                    short(f"slow_readers/slow{i}", p.slow_tokens, read_delay_s=p.slow_read_delay_s)
                    for i in range(p.slow_readers)
                ],
                "fast": [
                    short(f"slow_readers/fast{i}", p.slow_tokens)
                    for i in range(p.slow_fast_streams)
                ],
            },
            {"read_delay_s": p.slow_read_delay_s},
        )
    )
    # Background streams keep the engine stepping while the measured requests leave;
    # they are sized to outlast the measurements and are closed afterwards.
    bg_tokens = max(p.sustained_tokens, p.mixed_tokens) * 4
    scenarios.append(
        Scenario(
            "cancel_prefill",
            "cancel",
            {
                "background": [
                    short(f"cancel_prefill/bg{i}", bg_tokens) for i in range(p.cancel_background)
                ],
                "cancel": [
                    long(f"cancel_prefill/{i}", p.long_max_tokens, cancel_in_prefill=0.5)
                    for i in range(p.cancel_prefill)
                ],
            },
            {"stage": "prefill"},
        )
    )
    scenarios.append(
        Scenario(
            "cancel_decode",
            "cancel",
            {
                "background": [
                    short(f"cancel_decode/bg{i}", bg_tokens) for i in range(p.cancel_background)
                ],
                "cancel": [
                    short(
                        f"cancel_decode/{i}",
                        p.max_tokens * 8,
                        cancel_after_tokens=p.cancel_after_tokens,
                    )
                    for i in range(p.cancel_decode)
                ],
            },
            {"stage": "decode"},
        )
    )
    return Workload(p, seed, list(suppress_eos), scenarios, warmup)
