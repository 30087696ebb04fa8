"""Per-pool placement on labelled nodes: a pool's `resources:` ({name: amount per worker}) loads, is validated like
the other keys, and goes into every worker's placement-group bundle (the two-node test places pools with it)."""

import pytest

from coordinator.backend.placement_groups import worker_bundle
from coordinator.config.serve_config import load_serve_config
from engine.config_error import ConfigError


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_pool_resources_load_and_reach_the_worker_bundle(tmp_path):
    cfg = load_serve_config(write(tmp_path, "prefill:\n  num_cpus: 0.5\n  resources: {prefill_node: 1}\n"
                                            "decode:\n  num_gpus: 1\n  resources: {decode_node: 0.5, nvme: 2}\n"))
    assert cfg.prefill.resources == {"prefill_node": 1}
    assert worker_bundle(cfg.prefill) == {"CPU": 0.5, "prefill_node": 1}
    assert worker_bundle(cfg.decode) == {"CPU": 1, "GPU": 1, "decode_node": 0.5, "nvme": 2}


def test_pools_without_resources_ask_only_for_cpus_and_gpus(tmp_path):
    cfg = load_serve_config(write(tmp_path, "model: tiny\n"))
    assert cfg.prefill.resources == {} and cfg.decode.resources == {}
    assert worker_bundle(cfg.decode) == {"CPU": 1}


def test_resources_override_from_the_command_line_style_overrides(tmp_path):
    cfg = load_serve_config(write(tmp_path, "model: tiny\n"), {"decode.resources": {"decode_node": 1}})
    assert cfg.decode.resources == {"decode_node": 1}


@pytest.mark.parametrize("text, message", [
    ("prefill:\n  resources: prefill_node\n", "'prefill.resources' must be a mapping"),
    ("prefill:\n  resources: [prefill_node]\n", "'prefill.resources' must be a mapping"),
    ("decode:\n  resources: {GPU: 1}\n", "decode.resources.GPU: set CPUs and GPUs with num_cpus / num_gpus"),
    ("decode:\n  resources: {CPU: 1}\n", "decode.resources.CPU: set CPUs and GPUs"),
    ("decode:\n  resources: {decode_node: 0}\n", "decode.resources.decode_node must be a positive number"),
    ("decode:\n  resources: {decode_node: -1}\n", "decode.resources.decode_node must be a positive number"),
    ("decode:\n  resources: {decode_node: true}\n", "decode.resources.decode_node must be a positive number"),
    ("decode:\n  resources: {decode_node: one}\n", "decode.resources.decode_node must be a positive number"),
    ("decode:\n  resources: {decode_node: 1.5}\n", "Ray takes amounts above 1 only whole"),
    ("decode:\n  resources: {1: 1}\n", "resource names must be non-empty strings"),
    ("decode:\n  resource: {decode_node: 1}\n", "unknown key 'decode.resource'"),
    ("resources: {decode_node: 1}\n", "unknown key 'resources'"),
])
def test_bad_resources_name_file_key_and_reason(tmp_path, text, message):
    with pytest.raises(ConfigError, match="c.yaml") as err:
        load_serve_config(write(tmp_path, text))
    assert message in str(err.value)
