"""Which GPUs a worker shows itself before CUDA starts (kvtransfer.gpu_visibility), in real Ray actors: a server
started under CUDA_VISIBLE_DEVICES=2,3 (two servers on one 4-GPU host) has GPUs 2 and 3. Each worker sees its own
GPU first and its peer next, never GPUs 0 and 1 of the other server (that hid the peer: KV went the slow way)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtransfer.gpu_visibility import set_visible_gpus

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, os, ray
ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR")

@ray.remote(num_gpus=1, num_cpus=0)
class Worker:
    def expose(self):
        from kvtransfer.gpu_visibility import expose_peer_gpus, node_gpus
        own = expose_peer_gpus(node_gpus())
        return {"own": own, "visible": os.environ["CUDA_VISIBLE_DEVICES"]}

workers = [Worker.remote() for _ in range(2)]
print(json.dumps(ray.get([w.expose.remote() for w in workers])))
"""


def test_a_worker_sees_its_nodes_gpus_own_first():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "2,3", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(s["visible"] for s in seen) == ["2,3", "3,2"]
    assert all(s["visible"].split(",")[0] == str(s["own"][0]) for s in seen)


def test_visible_gpus_follow_the_nodes_list(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    set_visible_gpus([5, 4], [4, 5, 6, 7])  # a TP worker's two ranks, in rank order
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,4,6,7"
    set_visible_gpus(6, [4, 5, 6, 7], "one")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
