"""PNG plots of a run, when matplotlib is importable (it is not a dependency).

Owns three figures: latency percentiles vs concurrency, throughput vs
concurrency (every target: ceiling, engine, mlxd, peer), and the streams'
inter-token gaps over time during mixed pressure with the long prompt's arrival
and first token marked.
Without matplotlib it writes nothing and says so; the report carries the note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {
    "mlxd": "tab:blue",
    "peer": "tab:orange",
    "ceiling": "tab:green",
    "engine": "tab:purple",
}


def write_plots(
    summary: dict[str, dict[str, Any]], timelines: dict[str, Any], out_dir: Path
) -> dict[str, Any]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {
            "files": [],
            "note": "matplotlib is not installed (pip install matplotlib to get PNG plots)",
        }
    files = []
    sweep = {
        t: sorted(
            ((d["concurrency"], d) for d in s.values() if d.get("concurrency")), key=lambda x: x[0]
        )
        for t, s in summary.items()
    }

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for t, rows in sweep.items():
        if not rows:
            continue
        cs = [c for c, _ in rows]
        for ax, key in zip(axes, ("ttft_ms", "itl_ms"), strict=True):
            for q, style in (("p50", "-"), ("p99", "--")):
                ys = [d[key].get(q) for _, d in rows]
                if any(y is not None for y in ys):
                    ax.plot(cs, ys, style, marker="o", color=COLORS.get(t), label=f"{t} {q}")
    for ax, title in zip(axes, ("TTFT (ms)", "inter-token gap (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(_save(fig, out_dir / "latency_vs_concurrency.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for t, rows in sweep.items():
        if rows:
            ax.plot(
                [c for c, _ in rows],
                [d.get("tok_s") for _, d in rows],
                marker="o",
                color=COLORS.get(t),
                label=t,
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Aggregate throughput")
    ax.legend()
    fig.tight_layout()
    files.append(_save(fig, out_dir / "throughput_vs_concurrency.png"))
    plt.close(fig)

    if timelines:
        fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 3 * len(timelines)), squeeze=False)
        for ax, (t, tl) in zip(axes[:, 0], timelines.items(), strict=True):
            pts = tl.get("timeline") or []
            ax.scatter([p[0] for p in pts], [p[1] * 1e3 for p in pts], s=4, color=COLORS.get(t))
            if tl.get("arrival_s") is not None:
                ax.axvline(tl["arrival_s"], color="red", label="long prompt arrives")
            if tl.get("long_first_token_s") is not None:
                ax.axvline(
                    tl["long_first_token_s"], color="black", linestyle="--", label="its first token"
                )
            ax.set_title(f"{t}: streams' inter-token gaps during mixed pressure")
            ax.set_xlabel("seconds into the scenario")
            ax.set_ylabel("gap (ms)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(_save(fig, out_dir / "mixed_pressure_gaps.png"))
        plt.close(fig)
    return {"files": files, "note": ""}


def _save(fig: Any, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path.name
