"""YAML serving configs: the shipped ones load; every bad key or value fails naming the file, key and reason."""

from pathlib import Path

import pytest

from coordinator.config.serve_config import load_serve_config
from engine.config_error import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if "cluster" not in p.name))
def test_shipped_configs_load(name):
    cfg = load_serve_config(ROOT / "configs" / name)
    assert cfg.prefill.workers >= 1 and cfg.decode.workers >= 1


def test_default_config_is_cpu_tiny_one_prefill_one_decode():
    cfg = load_serve_config(ROOT / "configs" / "default.yaml")
    assert (cfg.model, cfg.mode, cfg.prefill.workers, cfg.decode.workers) == ("tiny", "disaggregated", 1, 1)
    engine = cfg.engine_config(cfg.prefill)
    assert engine.device == "cpu" and engine.max_prefill_chunk == 512


def test_gpu_config_puts_engines_on_cuda():
    cfg = load_serve_config(ROOT / "configs" / "gpu-1p1d-llama3-8b.yaml")
    engine = cfg.engine_config(cfg.decode)
    assert engine.device == "cuda" and cfg.decode.num_gpus == 1
    assert (engine.kernels, engine.cuda_graphs, engine.async_scheduling) == ("auto", True, True)


def test_a_pool_can_turn_the_gpu_fast_path_switches_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("decode:\n  kernels: torch\n  cuda_graphs: false\n  async_scheduling: false\n")
    cfg = load_serve_config(path)
    engine = cfg.engine_config(cfg.decode)
    assert (engine.kernels, engine.cuda_graphs, engine.async_scheduling) == ("torch", False, False)
    assert cfg.engine_config(cfg.prefill).async_scheduling is None  # the other pool keeps the default (by device)


def test_the_host_tier_is_on_by_default_and_a_pool_sizes_or_turns_it_off(tmp_path):
    text = "decode:\n  kv_host_cache_bytes: 0\nprefill:\n  kv_host_cache_bytes: 4096\n"
    cfg = load_serve_config(write(tmp_path, text))
    assert cfg.engine_config(cfg.decode).kv_host_cache_bytes == 0
    assert cfg.engine_config(cfg.prefill).kv_host_cache_bytes == 4096
    default = load_serve_config(ROOT / "configs" / "default.yaml")
    assert default.engine_config(default.decode).kv_host_cache_bytes is None  # sized from the host's memory


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("modle: tiny\n", "unknown key 'modle'"),
    ("prefill:\n  wrokers: 2\n", "unknown key 'prefill.wrokers'"),
    ("mode: split\n", "'mode' must be one of"),
    ("prefill:\n  workers: two\n", "'prefill.workers' must be int"),
    ("decode:\n  max_num_seqs: -3\n", "'decode.max_num_seqs' must not be negative"),
    ("server:\n  port: 70000\n", "ServerSettings.port"),
    ("server:\n  stream_interval: 0\n", "ServerSettings.stream_interval must be an integer in [1, 1024], got 0"),
    ("tenants:\n  - {name: bulk, api_keys: [k], stream_interval: 2.5}\n",
     "TenantConfig.stream_interval must be None or an integer in [1, 1024], got 2.5"),
    ("server: 8000\n", "'server' must be a mapping"),
    ("decode:\n  workers: 0\n", "decode: workers must be at least 1"),
    ("dtype: float8\n", "EngineConfig.dtype"),
    ("block_size: true\n", "'block_size' must be int"),
    ("decode:\n  kernels: cuda\n", "decode workers' engine: EngineConfig.kernels must be one of"),
    ("prefill:\n  async_scheduling: 1\n", "'prefill.async_scheduling' must be bool"),
    ("decode:\n  kv_host_cache_bytes: -1\n", "'decode.kv_host_cache_bytes' must not be negative"),
    ("prefill:\n  kv_host_cache_bytes: true\n", "'prefill.kv_host_cache_bytes' must be int"),
    ("prefill:\n  kv_host_cache_bytes: 2.5e9\n", "'prefill.kv_host_cache_bytes' must be int"),
    ("enable_prefix_caching: false\ndecode:\n  kv_host_cache_bytes: 1000000\n",
     "decode workers' engine: EngineConfig.kv_host_cache_bytes must be null"),
    ("transfer:\n  net_devices: 'eth0; rm -rf /'\n", "transfer: net_devices must name network devices"),
    ("transfer:\n  net_devices: 3\n", "'transfer.net_devices' must be"),
    ("[1, 2]\n", "top level must be a mapping"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_bad_values_name_file_key_and_reason(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="c.yaml") as err:
        cfg = load_serve_config(path)
        cfg.engine_config(cfg.prefill)  # engine-level checks run when a worker's part is built
    assert message in str(err.value)


def test_missing_file_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_serve_config(tmp_path / "absent.yaml")
    cfg = load_serve_config(write(tmp_path, "server:\n  port: 8000\n"), {"server.port": 8123, "mode": "collocated"})
    assert cfg.server.port == 8123 and cfg.mode == "collocated"


def test_transfer_net_devices_load_as_named(tmp_path):
    """The devices the config names go to every worker's KV agent (kvtransfer.worker_setup sets UCX_NET_DEVICES
    from them; tests/test_cluster_two_nodes.py serves with them on a private network)."""
    cfg = load_serve_config(write(tmp_path, "transfer:\n  net_devices: mlx5_0:1,eth1\n"))
    assert cfg.transfer.net_devices == "mlx5_0:1,eth1"
    assert load_serve_config(write(tmp_path, "model: tiny\n")).transfer.net_devices is None
