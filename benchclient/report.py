"""The sweep's Markdown report: setup, the best layout per workload under the SLOs, a table per workload, plots.

Owns the choice of "best": for each workload and load kind, the layout with the highest peak goodput over the
loads it ran (requests/s meeting both SLOs); ties go to the higher mean SLO attainment. If no layout met the
SLOs at any load, the report says so rather than naming one.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
from pathlib import Path

from benchclient.client_processes import CLIENT_BUSY
from benchclient.sweep_config import SweepConfig


def best_layouts(rows: list[dict]) -> list[dict]:
    """[{workload, load_kind, best, goodput, load, runner_up}] over rows whose status is ok."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for workload, kind in dict.fromkeys((r["workload"], r["load_kind"]) for r in ok):
        cells = [r for r in ok if (r["workload"], r["load_kind"]) == (workload, kind)]
        scores = []
        for layout in dict.fromkeys(r["layout"] for r in cells):
            mine = [r for r in cells if r["layout"] == layout]
            peak = max(mine, key=lambda r: (r["goodput"] or 0.0, -r["load_value"]))
            attain = sum(r["slo_attainment"] or 0.0 for r in mine) / len(mine)
            scores.append(((peak["goodput"] or 0.0, attain), layout, peak))
        scores.sort(key=lambda s: s[0], reverse=True)
        (score, layout, peak), rest = scores[0], scores[1:]
        out.append({"workload": workload, "load_kind": kind, "best": layout if score[0] > 0 else None,
                    "goodput": score[0], "attainment": score[1], "load": peak["load"],
                    "runner_up": (rest[0][1], rest[0][0][0]) if rest else None})
    return out


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _table(rows: list[dict]) -> list[str]:
    lines = ["| layout | load | goodput (req/s) | SLO met | completed / failed | req/s | output tok/s | "
             "TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | e2e p50 (ms) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['layout']} | {r['load']} | failed: see below | | | | | | | | |")
            continue
        lines.append(
            f"| {r['layout']} | {r['load']} | {_f(r['goodput'], '{:.2f}')} | {_f(r['slo_attainment'], '{:.0%}')} "
            f"| {r['completed']} / {r['failed']} | {_f(r['request_throughput'], '{:.2f}')} "
            f"| {_f(r['output_token_throughput'])} | {_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])} "
            f"| {_f(r['tpot_p50_ms'])} / {_f(r['tpot_p99_ms'])} | {_f(r['itl_p50_ms'])} / {_f(r['itl_p99_ms'])} "
            f"| {_f(r['e2e_p50_ms'])} |")
    return lines


def write_report(config: SweepConfig, rows: list[dict], plots: list[Path], out: Path,
                 command: str | None = None) -> Path:
    command = command or f"pdserve sweep {config.path}" + (
        "" if Path(out) == config.output_dir else f" --out {out}")
    wanted = {c.key for c in config.cells()}
    done = sum(r["status"] == "ok" for r in rows)
    lines = [f"# Pool-sizing sweep: {config.path.stem}", "",
             f"Made by `{command}` on {datetime.date.today().isoformat()}, on {platform.machine()} "
             f"{platform.system()} with {os.cpu_count()} CPUs{_gpus()}. Cells: {done} of {len(wanted)} ok.", "",
             *([config.description.strip(), ""] if config.description else []),
             f"- Serving config: `{config.base_config}`" + (
                 f" with {', '.join(f'`{k}={v}`' for k, v in config.overrides)}" if config.overrides else ""),
             f"- Layouts: {', '.join(_layout_text(lay) for lay in config.layouts)}",
             f"- Workloads: {', '.join(_workload_text(w) for w in config.workloads)}",
             f"- Loads: {', '.join(a.label for a in config.loads)}; per cell {config.warmup_s:g} s of warm-up "
             f"(left out) then {config.duration_s:g} s measured; `ignore_eos` {config.ignore_eos}",
             f"- SLOs: TTFT <= {config.slo.ttft_ms:g} ms and TPOT <= {config.slo.tpot_ms:g} ms. Goodput = requests/s "
             "that met both; TPOT = (e2e - TTFT) / (output tokens - 1); ITL = gaps between stream chunks. Rates "
             "are per measured window: a short Poisson sample can exceed the nominal rate.", "",
             "## Best layout per workload", "",
             "| workload | load kind | best layout | its peak goodput (req/s) | at | runner-up (peak goodput) |",
             "|---|---|---|---:|---|---|"]
    for b in best_layouts(rows):
        runner = f"{b['runner_up'][0]} ({b['runner_up'][1]:.2f})" if b["runner_up"] else "-"
        best = b["best"] or "none met the SLOs"
        lines.append(f"| {b['workload']} | {b['load_kind']} | **{best}** | {b['goodput']:.2f} | {b['load']} "
                     f"| {runner} |")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += ["", f"## Workload '{workload}'", ""] + _table([r for r in rows if r["workload"] == workload])
    if config.extra_slos:
        lines += ["", "## Goodput under each SLO pair", ""] + _slo_table(config, rows)
    lines += _adaptive_section(config, rows)
    lines += _cache_section(rows)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    loads = [r["loadavg_1m"] for r in rows if r.get("loadavg_1m") is not None]
    if loads:
        lines += ["", f"Host 1-minute load average at the end of each cell: {min(loads):.1f} to {max(loads):.1f} "
                  f"on {os.cpu_count()} CPUs (`loadavg_1m` in the table); other processes skew the figures."]
    lines += _client_note(rows)
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed cells", ""] + [f"- `{r['cell']}`: {(r['error'] or '')[:300]!r}" for r in failed]
    lines += ["", "Raw data: `results.csv`, `results.json` (one row per cell), `cells/*.json` (every request).", ""]
    path = Path(out) / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _client_note(rows: list[dict]) -> list[str]:
    """The load client's own CPU: cells where one of its processes was busy nearly all the time measured it too."""
    busy = [(r["cell"], r["client_busiest_cpu_s_per_s"]) for r in rows
            if (r.get("client_busiest_cpu_s_per_s") or 0) >= CLIENT_BUSY]
    if not busy:
        return []
    return ["", f"Load client: in {len(busy)} cell(s) a client process was busy {CLIENT_BUSY:.0%} or more of the "
            "time, so their chunk gaps and TTFT may be the client's own (`client_processes` in the sweep sends "
            "from more): " + ", ".join(f"`{cell}` ({cpu:.0%})" for cell, cpu in busy) + "."]


def _slo_pairs(config) -> list:
    return [config.slo, *config.extra_slos]


def _goodput(row: dict, slo, config) -> float | None:
    return row.get("goodput") if slo == config.slo else row.get(slo.goodput_key)


def _slo_table(config, rows: list[dict]) -> list[str]:
    pairs = _slo_pairs(config)
    lines = ["| workload | load | layout | " + " | ".join(f"goodput, TTFT <= {p.ttft_ms:g} / TPOT <= {p.tpot_ms:g} ms"
                                                      for p in pairs) + " |",
             "|---|---|---|" + "---:|" * len(pairs)]
    for r in (r for r in rows if r["status"] == "ok"):
        lines.append(f"| {r['workload']} | {r['load']} | {r['layout']} | "
                     + " | ".join(_f(_goodput(r, p, config), "{:.2f}") for p in pairs) + " |")
    return lines


def _cache_section(rows: list[dict]) -> list[str]:
    """Where the prompts' KV came from (rows with the server's tier counters or multi-turn figures)."""
    ok = [r for r in rows if r["status"] == "ok" and (r.get("cache_share_device") is not None
                                                       or r.get("ttft_later_turns_p50_ms") is not None)]
    if not ok:
        return []
    lines = ["", "## Prompt caching", "",
             "Cached share: prompt tokens the server reported cached (`usage.prompt_tokens_details`), measured "
             "requests. Device / host share: tokens admitted during the cell (warm-up included) whose KV the device "
             "prefix cache / the host tier supplied (the server's counters, benchclient.cache_tiers).", "",
             "| workload | load | layout | cached share | device share | host share "
             "| later turns' TTFT p50 / p99 (ms) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in ok:
        later = f"{_f(r.get('ttft_later_turns_p50_ms'), '{:.1f}')} / {_f(r.get('ttft_later_turns_p99_ms'), '{:.1f}')}"
        shares = " | ".join(_f(r.get(k), "{:.2f}") for k in ("cached_prompt_tokens_ratio", "cache_share_device",
                                                             "cache_share_host"))
        lines.append(f"| {r['workload']} | {r['load']} | {r['layout']} | {shares} | {later} |")
    return lines


def _served_slo(config, layout):
    """The SLO pair an adaptive layout serves (its serving config's `slo`)."""
    from benchclient.stats import SLO
    from coordinator.config.serve_config import load_serve_config
    slo = load_serve_config(config.base_config, {**dict(config.overrides), **layout.serve_overrides()}).slo
    return None if slo is None else SLO(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms)


def _adaptive_section(config, rows: list[dict]) -> list[str]:
    """Each adaptive layout against the best static layout at each load, under the SLO pair it serves."""
    adaptive = [lay for lay in config.layouts if lay.mode == "adaptive"]
    if not adaptive:
        return []
    static = {lay.name for lay in config.layouts if lay.mode != "adaptive"}
    pairs = {p.goodput_key: p for p in _slo_pairs(config)}
    lines = ["", "## Adaptive against the best static layout", "",
             "Each adaptive layout is judged under the SLO pair it serves (its `slo`), against the static layout "
             "with the highest goodput under the same pair at the same load, in the same sweep.", "",
             "| workload | load | SLO (TTFT / TPOT ms) | best static | its goodput | adaptive layout | goodput "
             "| ratio |",
             "|---|---|---|---|---:|---|---:|---:|"]
    ratios = []
    ok = [r for r in rows if r["status"] == "ok"]
    for lay in adaptive:
        served = _served_slo(config, lay)
        slo = pairs.get(served.goodput_key) if served is not None else None
        if slo is None:
            lines.append(f"| - | - | - | - | - | {lay.name} | its SLO is not among the sweep's pairs | - |")
            continue
        for r in (r for r in ok if r["layout"] == lay.name):
            peers = [(_goodput(p, slo, config) or 0.0, p["layout"]) for p in ok
                     if p["layout"] in static and p["workload"] == r["workload"] and p["load"] == r["load"]]
            if not peers:
                continue
            best, name = max(peers)
            mine = _goodput(r, slo, config) or 0.0
            ratio = mine / best if best > 0 else None
            ratios.append(ratio)
            lines.append(f"| {r['workload']} | {r['load']} | {slo.ttft_ms:g} / {slo.tpot_ms:g} | {name} | {best:.2f} "
                         f"| {lay.name} | {mine:.2f} | {_f(ratio, '{:.2f}')} |")
    known = [x for x in ratios if x is not None]
    if known:
        lines += ["", f"Ratio to the best static layout: lowest {min(known):.2f}, highest {max(known):.2f} over "
                  f"{len(known)} cells."]
    return lines


def _gpus() -> str:
    """', 2 x NVIDIA H200' when nvidia-smi answers, else ''."""
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return ""
    names = [n.strip() for n in out if n.strip()]
    return ", " + ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names)) if names else ""


def _layout_text(lay) -> str:
    return f"{lay.name} ({lay.mode}, {lay.workers} workers)"


def _workload_text(w) -> str:
    lengths = f"{w.input_len} in / {w.output_len} out" if w.kind not in ("jsonl", "sharegpt") else w.path
    return f"{w.name} ({w.kind}, {lengths}, {w.prompt_format} prompts)"
