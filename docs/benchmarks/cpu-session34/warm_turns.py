"""Each one-step (warm) shared-prefix turn of a `bench trace` run, its TTFT split.

    python warm_turns.py trace.json  > warm-turns.md

Reads the Chrome trace `bench trace` writes: the client's "to first token"
span, the gateway's request marks (arrival, tokenized, submitted,
first_token) and the worker's step lane. Each turn whose first token took
one step: the warm turns, and a cold one whose whole prompt fit one pass
(turn 12 of session 34's llama8b traces, 2,007 tokens). Cold turns of
several steps are left out. ms.
"""

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = (
    "turn",
    "prompt tokens",
    "network",
    "tokenize",
    "queue and submit",
    "submitted to the step",
    "the step",
    "step end to gateway",
    "delivery",
    "TTFT",
)


def turns(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The client's turns in order, each with the gateway's marks and the worker
    steps before its first token (a trace runs one turn at a time)."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for e in sorted(events, key=lambda e: e.get("ts", 0)):
        name, pid = e["name"], e["pid"]
        if pid == 2 and name == "to first token":
            cur = {"sent": e["ts"], "ttft": e["dur"], "steps": []}
            out.append(cur)
        elif cur is None:
            continue
        elif pid == 1 and name in ("arrival", "tokenized", "submitted", "first_token"):
            cur.setdefault(name, e["ts"])
        elif pid == 3 and name.startswith("step +") and "first_token" not in cur:
            cur["steps"].append((e["ts"], e["dur"], int(name.split("+")[1].split()[0])))
    return out


def ms(a: float, b: float) -> str:
    return f"{(b - a) / 1000:.2f}"


def row(i: int, c: dict[str, Any]) -> str:
    ts, dur, tokens = c["steps"][0]
    cells = [
        str(i),
        str(tokens),
        ms(c["sent"], c["arrival"]),
        ms(c["arrival"], c["tokenized"]),
        ms(c["tokenized"], c["submitted"]),
        ms(c["submitted"], ts),
        ms(0, dur),
        ms(ts + dur, c["first_token"]),
        ms(c["first_token"], c["sent"] + c["ttft"]),
        ms(0, c["ttft"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    trace = json.loads(Path(sys.argv[1]).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for i, c in enumerate(turns([e for e in events if e.get("ph") != "M"])):
        if len(c["steps"]) == 1:
            print(row(i, c))


if __name__ == "__main__":
    main()
