"""The CPU smoke sweep end to end: the real `pdserve serve` per layout, real load, the table, plots and report.

One cell is recorded as done before the sweep starts (as if an earlier run had been interrupted after it), so
the run also shows resumption: that cell is skipped, the other three run on two fresh servers.
"""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchclient.client import RequestResult
from benchclient.stats import SLO, summarize
from benchclient.sweep import ROWS, cell_row, run_sweep
from benchclient.sweep_config import load_sweep_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sweeps" / "cpu-smoke.yaml"


def _earlier_row(cell):
    """A row as an interrupted earlier sweep left it (figures from known timestamps)."""
    results = [RequestResult(start=t, input_len=256, max_tokens=32, chunk_times=[t + 0.1, t + 0.5], end=t + 0.5,
                             prompt_tokens=256, completion_tokens=32, tokens_from_usage=True) for t in range(8)]
    # its load client was busy all the time (the report names such cells)
    return cell_row(cell, summarize(results, SLO(250, 40)) | {"client_busiest_cpu_s_per_s": 0.97}, "ok", None)


@pytest.mark.timeout(420)
def test_cpu_smoke_sweep_writes_table_plots_and_report_and_resumes(tmp_path):
    config = load_sweep_config(CONFIG)
    cells = config.cells()
    assert len(cells) == 4 and len(config.layouts) == 2
    earlier = _earlier_row(cells[-1])
    (tmp_path / ROWS).write_text(json.dumps(earlier) + "\n" + '{"cell": "cut off mid-wri')

    outcome = run_sweep(config, out_dir=tmp_path, progress=False)

    assert (outcome.ran, outcome.skipped, outcome.failed) == (3, 1, 0), (tmp_path / "report.md").read_text()
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["cell"] for r in table] == [c.key for c in cells]
    assert {r["status"] for r in table} == {"ok"}
    for row, cell in zip(table[:3], cells, strict=False):  # measured now, on the real server
        assert int(row["completed"]) > 0 and row["failed"] == "0", row
        assert float(row["completion_tokens_mean"]) == 32 and float(row["prompt_tokens_mean"]) == 256
        assert float(row["goodput"]) <= float(row["request_throughput"])
        assert 0 < float(row["ttft_p50_ms"]) <= float(row["ttft_p99_ms"])
        assert 0 < float(row["client_busiest_cpu_s_per_s"]) < 2, row  # its one client process's CPU
        # the server's own counters, read around the cell: its first cell found no prefix; a later one on the same
        # server sends the same seeded prompts again (its device caches hold some: none went to the host tiers)
        first = row["cell"] == cells[0].key
        assert 0 <= float(row["cache_share_device"]) <= (0 if first else 1), row
        assert float(row["cache_share_host"]) == 0.0, row
        assert (tmp_path / "cells" / f"{cell.slug}.json").exists()
    assert not (tmp_path / "cells" / f"{cells[-1].slug}.json").exists()  # skipped, not rerun
    assert len(json.loads((tmp_path / "results.json").read_text())) == 4
    for png in ("goodput.png", "latency.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    report = (tmp_path / "report.md").read_text()
    assert "## Best layout per workload" in report and "![goodput](goodput.png)" in report
    assert "| short-chat | rate | **" in report and "Cells: 4 of 4 ok" in report and "## Prompt caching" in report
    for layout in config.layouts:
        assert f"| {layout.name} | rate=3 |" in report
    assert f"`{cells[-1].key}` (97%)" in report.split("Load client:")[1]  # the earlier row's busy client, named

    # Everything done: a second run (through the CLI) launches nothing and rewrites the outputs.
    (tmp_path / "report.md").unlink()
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "sweep", str(CONFIG), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "0 cells run, 4 already done, 0 failed" in done.stdout
    assert (tmp_path / "report.md").exists()
