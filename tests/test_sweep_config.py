"""Sweep config validation: every bad key or value fails at load naming the file, the key and the reason."""

import re
from pathlib import Path

import pytest
import yaml

from benchclient.launcher import serving_config
from benchclient.sweep_config import load_sweep_config
from engine.config_error import ConfigError

ROOT = Path(__file__).resolve().parents[1]
GOOD = {
    "base_config": str(ROOT / "configs" / "default.yaml"),
    "overrides": {"decode.num_cpus": 0.5},
    "layouts": [{"prefill": 1, "decode": 1}, {"name": "co", "mode": "collocated", "workers": 2}],
    "workloads": [{"name": "w", "kind": "fixed", "input_len": 8, "output_len": 4}],
    "loads": {"rates": [1, 2.5], "concurrencies": [4]},
    "slo": {"ttft_ms": 100, "tpot_ms": 20},
}


def _load(tmp_path, **changes):
    raw = {**GOOD, **changes}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}))
    return load_sweep_config(path)


def test_a_good_config_and_its_cells(tmp_path):
    cfg = _load(tmp_path)
    assert [lay.name for lay in cfg.layouts] == ["1P+1D", "co"]
    assert [c.key for c in cfg.cells()][:3] == ["1P+1D|w|rate=1", "1P+1D|w|rate=2.5", "1P+1D|w|concurrency=4"]
    assert len(cfg.cells()) == 6 and cfg.slo.ttft_ms == 100 and cfg.ignore_eos
    serve = serving_config(cfg.base_config, {**dict(cfg.overrides), **cfg.layouts[1].serve_overrides()}, 9999, None)
    assert serve["mode"] == "collocated" and serve["decode"]["workers"] == 2 and serve["decode"]["num_cpus"] == 0.5
    assert serve["server"] == {"host": "127.0.0.1", "port": 9999} and "ray_address" not in serve


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_sweep_configs_load(path):
    cfg = load_sweep_config(path)
    assert len(cfg.layouts) >= 2 and {lay.workers for lay in cfg.layouts} == {cfg.layouts[0].workers}


BAD = [
    ({"layots": []}, "layots", "unknown key"),
    ({"layouts": None}, "layouts", "is required"),
    ({"base_config": "nowhere.yaml"}, "base_config", "no such file"),
    ({"layouts": [{"prefill": 1, "decode": 1}, {"prefill": 0, "decode": 2}]}, "layouts[1].prefill",
     "must be a positive integer"),
    ({"layouts": [{"mode": "hybrid", "workers": 2}]}, "layouts[0].mode",
     "must be 'disaggregated', 'collocated' or 'adaptive'"),
    ({"layouts": [{"mode": "collocated", "workers": 2, "decode": 1}]}, "layouts[0]", "not prefill/decode"),
    ({"layouts": [{"prefill": 1, "decode": 1, "gpus": 2}]}, "layouts[0].gpus", "unknown key"),
    ({"layouts": [{"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}]}, "layouts", "names must be unique"),
    ({"layouts": [{"prefill": 1, "decode": 1, "set": {"decode.max_num_seqs": "many"}}]}, "layouts[0]",
     "its serving config is invalid: .*decode.max_num_seqs"),
    ({"overrides": {"prefill.colour": 1}}, "layouts[0]", "unknown key 'prefill.colour'"),
    ({"workloads": [{"kind": "zipf"}]}, "workloads[0]", "kind must be one of"),
    ({"workloads": [{"kind": "fixed", "input_len": 0}]}, "workloads[0]", "input_len must be a positive integer"),
    ({"workloads": [{"kind": "fixed", "outputs": 3}]}, "workloads[0]", "unknown key 'outputs'"),
    ({"workloads": []}, "workloads", "must be a non-empty list"),
    ({"workloads": [{"kind": "jsonl", "path": "/nowhere/w.jsonl"}]}, "workloads[0]", "No such file"),
    ({"loads": {"rates": [1, 0]}}, "loads.rates[1]", "positive rate"),
    ({"loads": {"concurrencies": [2, 1.5]}}, "loads.concurrencies[1]", "positive integer"),
    ({"loads": {"arrival": "uniform", "rates": [1]}}, "loads.arrival", "must be 'poisson' or 'gamma'"),
    ({"loads": {}}, "loads", "give `rates`"),
    ({"slo": {"ttft_ms": -5}}, "slo", "ttft_ms must be a positive number"),
    ({"slo": {"tbt_ms": 5}}, "slo.tbt_ms", "unknown key"),
    ({"duration_s": 0}, "duration_s", "must be a positive number"),
    ({"warmup_s": "a while"}, "warmup_s", "must be a non-negative number"),
    ({"endpoint": "embeddings"}, "endpoint", "must be 'completions' or 'chat'"),
    ({"restart_per_cell": "yes"}, "restart_per_cell", "must be a bool"),
]


@pytest.mark.parametrize("changes, key, reason", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_bad_keys_and_values_name_file_key_and_reason(tmp_path, changes, key, reason):
    with pytest.raises(ConfigError, match=rf"sweep\.yaml: {re.escape(key)}: (.* )?{reason}"):
        _load(tmp_path, **changes)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: no such sweep config"):
        load_sweep_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("layouts: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_sweep_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="list.yaml: top level: must be a mapping"):
        load_sweep_config(tmp_path / "list.yaml")
