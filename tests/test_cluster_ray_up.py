"""`ray up` for real with configs/cluster-local.yaml (Ray's local provider over SSH): an SSH server on 127.0.0.1
with a throw-away key, the shipped config pointed at it (head_ip, ssh user and key, cluster name: nothing else
changes), `ray up -y` syncs the checkout, runs the setup and starts Ray and `pdserve serve` on the head; a
streamed completion over HTTP equals the single engine's; `ray exec` shows the cluster and stops the server
(it drains); `ray down -y`; then nothing is left running. Runs in its own namespaces (cluster_helpers)."""

import pytest
import yaml

from engine import LLM, SamplingParams
from tests.cluster_helpers import MAX_TOKENS, PROMPT, ROOT, ensure_ssh_tools, isolation_unavailable, run_isolated

pytestmark = pytest.mark.skipif(isolation_unavailable() is not None, reason=str(isolation_unavailable()))


def test_ray_up_over_ssh_serves_a_stream_and_ray_down_leaves_nothing_running(tmp_path):
    reason = ensure_ssh_tools()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path / "ray_up"
    seen = run_isolated("ray_up_local", workdir, timeout_s=420)

    shipped = yaml.safe_load((ROOT / "configs" / "cluster-local.yaml").read_text())
    used = yaml.safe_load((workdir / "cluster-local.yaml").read_text())
    assert {k for k in shipped.keys() | used.keys() if shipped.get(k) != used.get(k)} <= {
        "cluster_name", "provider", "auth"}
    assert {"configs", "coordinator", "engine", "pyproject.toml"} <= set(seen["synced"]), seen["synced"]
    assert ".git" not in seen["synced"] and ".cache" not in seen["synced"]

    want = LLM("tiny").generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    got = seen["completion"]
    assert (got["text"], got["completion_tokens"], got["finish_reason"]) == (want[0].text, MAX_TOKENS, "length")

    assert "1 local.cluster.node" in seen["ray_status"], seen["ray_status"][-2000:]
    assert "draining" in seen["stop_output"] and "Finished server process" in seen["stop_output"]
    assert seen["server_still_answers"] is False
    assert "No nodes remaining" in seen["down"], seen["down"][-2000:]
    assert seen["left_running"] == [], seen["left_running"]
