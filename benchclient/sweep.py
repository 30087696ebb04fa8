"""`pdserve sweep`: run every cell (layout x workload x load) of a SweepConfig and write the results.

Owns the run order and resumption. A layout's pending cells run on one freshly launched server (or one each
with `restart_per_cell`), which is torn down before the next layout starts. After each cell one row is appended
to `results.jsonl` (and the cell's full run, every request and its server-side phases included, saved under
`cells/`), so an interrupted sweep, run again, skips the cells whose row says `ok` and redoes the rest (a cell is
known by its layout name, workload name and load: rename one whose settings change). A layout whose server fails
to start records its cells as failed (with the reason) and the sweep goes on. At the end (and on every resume) the
table (`results.csv`, `results.json`), the plots and `report.md` are rewritten from all rows.
"""

from __future__ import annotations

import asyncio
import csv
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchclient.cache_tiers import read_tier_counters, tier_shares
from benchclient.client import Target, first_model
from benchclient.launcher import LaunchError, launched_server, serving_config
from benchclient.run import RunConfig, json_safe, measured_load, run_report, save_json
from benchclient.stats import summarize
from benchclient.sweep_config import Cell, SweepConfig

ROWS = "results.jsonl"
SUMMARY_COLUMNS = ("requests", "completed", "failed", "duration_s", "goodput", "slo_attainment",
                   "request_throughput", "output_token_throughput", "total_token_throughput",
                   "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                   "tpot_mean_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
                   "itl_mean_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms",
                   "e2e_mean_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms",
                   "prompt_tokens_mean", "completion_tokens_mean", "cached_prompt_tokens_ratio",
                   "ttft_later_turns_p50_ms", "ttft_later_turns_p99_ms", "cache_share_device", "cache_share_host",
                   "client_busiest_cpu_s_per_s")
COLUMNS = ("cell", "status", "layout", "mode", "prefill_workers", "decode_workers", "workers", "workload",
           "load", "load_kind", "load_value") + SUMMARY_COLUMNS + (
    "errors", "error", "finished_at", "loadavg_1m")


@dataclass(frozen=True)
class SweepOutcome:
    ran: int
    skipped: int
    failed: int
    report: Path


def run_sweep(config: SweepConfig, out_dir: str | Path | None = None, progress: bool | None = None) -> SweepOutcome:
    out = Path(out_dir or config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = sys.stderr.isatty() if progress is None else progress
    done = {key for key, row in load_rows(out).items() if row["status"] == "ok"}
    ran = failed = skipped = 0
    for layout in config.layouts:
        pending = [c for c in config.cells() if c.layout == layout and c.key not in done]
        skipped += sum(c.layout == layout for c in config.cells()) - len(pending)
        groups = [[c] for c in pending] if config.restart_per_cell else ([pending] if pending else [])
        for group in groups:
            results = _run_group(config, group, out, progress)
            ran += len(results)
            failed += sum(row["status"] != "ok" for row in results)
    every = load_rows(out)  # rows of cells this config no longer has stay in results.jsonl, out of the report
    rows = [every[c.key] for c in config.cells() if c.key in every]
    write_table(rows, out)
    from benchclient.plots import plot_all  # lazy: matplotlib
    from benchclient.report import write_report
    plots = plot_all(rows, out, config.slo)
    report = write_report(config, rows, plots, out)
    return SweepOutcome(ran=ran, skipped=skipped, failed=failed, report=report)


def _run_group(config: SweepConfig, cells: list[Cell], out: Path, progress: bool) -> list[dict]:
    """One server for `cells` (all of one layout); a row per cell, appended as soon as it is known."""
    layout = cells[0].layout
    serve = serving_config(config.base_config, {**dict(config.overrides), **layout.serve_overrides()},
                           None, config.ray_address)
    workdir = out / "servers" / (cells[0].slug if config.restart_per_cell else layout.name.replace(" ", "_"))
    rows: list[dict] = []
    print(f"[sweep] {layout.name}: starting the server for {len(cells)} cell(s)", file=sys.stderr, flush=True)
    try:
        with launched_server(serve, workdir, config.start_timeout_s) as server:
            url = server.url
            model = first_model(url)
            for cell in cells:
                print(f"[sweep] {cell.key}", file=sys.stderr, flush=True)
                rows.append(_append(out, _run_cell(config, cell, url, model, out, progress)))
    except (LaunchError, ValueError) as e:  # ValueError: the server answered /health but lists no model
        for cell in cells[len(rows):]:
            rows.append(_append(out, cell_row(cell, None, "failed", str(e)[-1500:])))
    return rows


def _run_cell(config: SweepConfig, cell: Cell, url: str, model: str, out: Path, progress: bool) -> dict:
    target = Target(url=url, model=model, endpoint=config.endpoint, ignore_eos=config.ignore_eos, phases=True)
    run = RunConfig(target=target, workload=cell.workload, arrival=cell.arrival, slo=config.slo,
                    duration_s=config.duration_s, warmup_s=config.warmup_s, timeout_s=config.timeout_s,
                    client_processes=min(config.client_processes, cell.arrival.concurrency or config.client_processes))
    before = read_tier_counters(url)
    measured = asyncio.run(measured_load(run, progress=progress))
    results = measured.results
    doc = run_report(run, results, measured.client)
    doc["summary"]["client_busiest_cpu_s_per_s"] = round(measured.client.busiest, 3)  # the report flags >= 0.85
    doc["summary"].update(tier_shares(before, read_tier_counters(url)))  # the server's own, warm-up included
    doc["cell"] = {"key": cell.key, "layout": cell.layout.name, "serve_overrides": cell.layout.serve_overrides()}
    extra = {s.goodput_key: summarize(results, s)["goodput"] for s in config.extra_slos}
    doc["summary"].update(extra)
    save_json(doc, out / "cells" / f"{cell.slug}.json")
    return cell_row(cell, doc["summary"], "ok", None, extra.keys())


def cell_row(cell: Cell, summary: dict | None, status: str, error: str | None,
             extra_keys: Any = ()) -> dict[str, Any]:
    lay, arr = cell.layout, cell.arrival
    row: dict[str, Any] = {
        "cell": cell.key, "status": status, "layout": lay.name, "mode": lay.mode, "prefill_workers": lay.prefill,
        "decode_workers": lay.decode, "workers": lay.workers, "workload": cell.workload.name, "load": arr.label,
        "load_kind": "rate" if arr.open_loop else "concurrency",
        "load_value": arr.rate if arr.open_loop else arr.concurrency}
    for key in (*SUMMARY_COLUMNS, *extra_keys):
        row[key] = summary.get(key) if summary else None
    errors = (summary or {}).get("errors") or {}
    row["errors"] = "; ".join(f"{k} x{v}" for k, v in sorted(errors.items()))
    row["error"] = error
    row["finished_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    row["loadavg_1m"] = os.getloadavg()[0]  # other processes on the host skew a cell: the report shows this
    return row


def _append(out: Path, row: dict) -> dict:
    path = out / ROWS
    with open(path, "ab") as f:
        if f.tell() > 0:  # a line cut off by a killed sweep must not swallow this row
            with open(path, "rb") as r:
                r.seek(-1, 2)
                if r.read(1) != b"\n":
                    f.write(b"\n")
        f.write(json.dumps(json_safe(row)).encode() + b"\n")
    return row


def load_rows(out: Path) -> dict[str, dict]:
    """{cell key: its latest row}; a cut-off last line (a sweep killed mid-write) is ignored."""
    path = Path(out) / ROWS
    rows: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row["cell"]] = row
    return rows


def write_table(rows: list[dict], out: Path) -> None:
    (out / "results.json").write_text(json.dumps([json_safe(r) for r in rows], indent=1) + "\n")
    extra = [k for k in dict.fromkeys(k for r in rows for k in r) if k.startswith("goodput@")]
    columns = (*COLUMNS, *extra)
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
