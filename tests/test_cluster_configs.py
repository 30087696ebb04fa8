"""The `ray up` cluster configs (configs/cluster.yaml for a cloud, configs/cluster-local.yaml on-premise) pass Ray's
own cluster-config schema the way `ray up` applies it (Ray's defaults merged in, then validated), and agree with
the serving configs their head starts: the file exists and loads, and on the cloud cluster every pool's custom
resource is offered by a node type that `ray up` starts enough of, and that the autoscaler can grow to the pool's
max_workers (the decode pool scales: its node type is an autoscaling group)."""

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from coordinator.backend.pools import worker_bundle
from coordinator.config.serve_config import load_serve_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_CONFIGS = ["cluster.yaml", "cluster-local.yaml"]


def ray_up_view(name: str) -> dict:
    """The config as `ray up` validates it: Ray's defaults for the provider merged in, then Ray's schema."""
    config = prepare_config(yaml.safe_load((ROOT / "configs" / name).read_text()))
    validate_config(config)
    return config


def served_config(config: dict):
    commands = " ".join(config["head_start_ray_commands"])
    match = re.search(r"pdserve serve (\S+)", commands)
    assert match, "the head starts `pdserve serve CONFIG`"
    assert "--ray-address auto" in commands, "the server joins the cluster `ray up` started"
    return load_serve_config(ROOT / match.group(1))


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_config_passes_rays_schema(name):
    config = ray_up_view(name)
    assert config["cluster_name"].startswith("pdserve")
    assert config["file_mounts"]["~/pdserve"] == ".", "the checkout is synced to every node"
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert any("~/pdserve/.venv" in c or ".venv/bin/pdserve" in c for c in config[key]), key


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_the_schema_check_rejects_a_broken_copy(name):
    """The check above can fail: a misspelt key or a wrong type in the same file does not pass."""
    raw = yaml.safe_load((ROOT / "configs" / name).read_text())
    misspelt = copy.deepcopy(raw)
    misspelt["setup_comands"] = misspelt.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError, match="setup_comands"):
        validate_config(prepare_config(misspelt))
    wrong_type = copy.deepcopy(raw)
    wrong_type["head_start_ray_commands"] = "ray start --head"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(wrong_type))


def test_cloud_cluster_offers_what_the_served_pools_ask_for():
    config = ray_up_view("cluster.yaml")
    serve = served_config(config)
    node_types = config["available_node_types"]
    assert config["head_node_type"] == "head" and "GPU" not in node_types["head"]["resources"]
    for role in ("prefill", "decode"):
        pool = getattr(serve, role)
        assert pool.num_gpus >= 1 and pool.resources, f"{role} workers are GPU workers on labelled nodes"
        for resource, per_worker in worker_bundle(pool).items():
            if resource in ("CPU", "GPU"):
                continue  # detected from the instance type by `ray up`
            offering = [t for t in node_types.values() if resource in t["resources"]]
            assert len(offering) == 1, f"one node type offers {resource}"
            started = offering[0]["min_workers"] * offering[0]["resources"][resource]
            assert started >= pool.workers * per_worker, f"`ray up` starts too few {resource} nodes for {role}"
            grown = offering[0]["max_workers"] * offering[0]["resources"][resource]
            assert grown >= pool.most * per_worker, f"the autoscaler cannot bring {role}'s max_workers"
            if pool.scales:  # the group pdserve grows: more nodes than `ray up` starts
                assert offering[0]["max_workers"] > offering[0]["min_workers"], role
    assert serve.scaling_pools == ("decode",), "the cloud example shows a pool that scales"
    assert sum(t.get("max_workers", 0) for t in node_types.values()) <= config["max_workers"]
    prefill_type = next(t for t in node_types.values() if "prefill_node" in t["resources"])
    assert "decode_node" not in prefill_type["resources"], "prefill and decode nodes are distinct"


def test_local_cluster_serves_a_config_that_fits_any_host():
    config = ray_up_view("cluster-local.yaml")
    assert config["provider"]["type"] == "local" and "head_ip" in config["provider"]
    serve = served_config(config)
    assert serve.prefill.resources == {} and serve.decode.resources == {}, "no host labels needed to start"
