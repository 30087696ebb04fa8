"""The sweep's PNG plots, drawn from its result rows (only cells whose status is `ok`).

Owns two figures, one row of panels per (workload, load kind): `goodput.png` (goodput vs offered load, one line
per layout, the offered rate as a dashed reference: goodput cannot exceed it) and `latency.png` (TTFT, TPOT and
inter-token latency p50 solid / p99 dashed vs load, with the SLO as a grey line). Each layout keeps its colour in
both figures. Headless (Agg backend), so it runs on servers and in tests.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from matplotlib.lines import Line2D  # noqa: E402

from benchclient.stats import SLO  # noqa: E402

XLABEL = {"rate": "offered load (requests/s, {arrival})", "concurrency": "concurrency (requests in flight)"}
LATENCIES = (("ttft", "Time to first token", "ttft_ms"), ("tpot", "Time per output token", "tpot_ms"),
             ("itl", "Inter-token latency (per chunk)", None))


def _panels(rows: list[dict]) -> list[tuple[str, str, list[dict]]]:
    keys = list(dict.fromkeys((r["workload"], r["load_kind"]) for r in rows))
    return [(w, k, [r for r in rows if (r["workload"], r["load_kind"]) == (w, k)]) for w, k in keys]


def _series(rows: list[dict], layout: str, column: str) -> tuple[list[float], list[float]]:
    pts = sorted((r["load_value"], r[column]) for r in rows if r["layout"] == layout and r[column] is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _xlabel(kind: str, rows: list[dict]) -> str:
    arrival = "gamma" if any("gamma" in r["load"] for r in rows) else "Poisson"
    return XLABEL[kind].format(arrival=arrival)


def plot_all(rows: list[dict], out: Path, slo: SLO) -> list[Path]:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    layouts = list(dict.fromkeys(r["layout"] for r in ok))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(layouts)}
    return [plot_goodput(ok, out / "goodput.png", colors, slo), plot_latency(ok, out / "latency.png", colors, slo)]


def plot_goodput(rows: list[dict], path: Path, colors: dict, slo: SLO) -> Path:
    panels = _panels(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, (workload, kind, prow) in zip(axes[0], panels, strict=True):
        for layout, color in colors.items():
            x, y = _series(prow, layout, "goodput")
            if x:
                ax.plot(x, y, "o-", color=color, label=layout, linewidth=2)
        if kind == "rate":
            loads = sorted({r["load_value"] for r in prow})
            ax.plot(loads, loads, "--", color="grey", linewidth=1, label="nominal offered rate")
        ax.set_title(f"Goodput, workload '{workload}'\n(SLOs: TTFT <= {slo.ttft_ms:g} ms, "
                     f"TPOT <= {slo.tpot_ms:g} ms)")
        ax.set_xlabel(_xlabel(kind, prow))
        ax.set_ylabel("goodput (requests/s meeting both SLOs)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(title="layout", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(rows: list[dict], path: Path, colors: dict, slo: SLO) -> Path:
    panels = _panels(rows)
    fig, axes = plt.subplots(len(panels), len(LATENCIES), figsize=(5.5 * len(LATENCIES), 4.3 * len(panels)),
                             squeeze=False)
    for axrow, (workload, kind, prow) in zip(axes, panels, strict=True):
        for ax, (metric, title, slo_field) in zip(axrow, LATENCIES, strict=True):
            values = []
            for layout, color in colors.items():
                for q, style in (("p50", "o-"), ("p99", "^--")):
                    x, y = _series(prow, layout, f"{metric}_{q}_ms")
                    values += y
                    if x:
                        ax.plot(x, y, style, color=color, linewidth=1.8)
            if slo_field:
                ax.axhline(getattr(slo, slo_field), color="grey", linewidth=1, linestyle=":")
            if values and min(values) > 0 and max(values) / min(values) > 30:
                ax.set_yscale("log")
            ax.set_title(f"{title}, workload '{workload}'")
            ax.set_xlabel(_xlabel(kind, prow))
            ax.set_ylabel(f"{metric.upper()} (ms)")
            ax.grid(alpha=0.3, which="both")
        handles = [Line2D([], [], color=c, linewidth=2, label=name) for name, c in colors.items()]
        handles += [Line2D([], [], color="black", marker="o", label="p50"),
                    Line2D([], [], color="black", marker="^", linestyle="--", label="p99"),
                    Line2D([], [], color="grey", linestyle=":", label="SLO")]
        axrow[-1].legend(handles=handles, fontsize=9, title="layout / percentile", loc="upper left",
                         bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
