"""benchmarks/tree_ab.py: treeab's summary pairs each engine's cases across the two trees' interleaved runs."""

from __future__ import annotations

import json

from benchmarks.tree_ab import summary


def _row(case: str, ms: float) -> str:
    return json.dumps({"case": case, "step_ms": ms, "x_floor": 1.2})


def test_summary_means_each_trees_runs_and_their_ratio(tmp_path):
    one, many = "decode batch 1, 1024 context", "decode batch 64, 2048 context"
    (tmp_path / "treeab-base-fp8.log").write_text("\n".join(
        ["noise", _row(one, 3.4), _row(many, 7.4), '{"static_context_lens": [1]}', _row(one, 3.2), _row(many, 7.2)]))
    (tmp_path / "treeab-new-fp8.log").write_text("\n".join([_row(one, 3.0), _row(many, 7.3), _row(one, 3.0)]))
    (tmp_path / "treeab-base-bf16.log").write_text(_row(one, 5.6))  # no new bf16 runs: no bf16 rows
    rows = summary(tmp_path)
    assert [(r["engine"], r["case"]) for r in rows] == [("fp8", one), ("fp8", many)]
    assert rows[0]["base_ms"] == 3.3 and rows[0]["new_ms"] == 3.0 and rows[0]["speedup"] == 1.1
    assert rows[1]["base_runs"] == [7.4, 7.2] and rows[1]["new_runs"] == [7.3] and rows[1]["speedup"] == 1.0
