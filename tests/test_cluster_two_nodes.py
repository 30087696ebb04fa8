"""A two-node Ray cluster on one machine: a head started with `--resources '{"prefill_node": 4}'`, a second
`ray start --address` node with `{"decode_node": 4}`, and `pdserve serve --ray-address auto` whose pools ask for
those resources. Ray reports every prefill worker on the head and every decode worker on the other node, and a
streamed completion equals the single engine's greedy output, so the prompt's KV crossed from one node to the
other (the decode worker continues from it without recomputing). The nodes sit on their own addresses of a private
network (a veth pair, cluster_helpers.private_network), the config names its devices (`transfer.net_devices`) and
UCX may use TCP only: the KV crosses by TCP between agents that connect by UCX worker address, and no worker listens
off those addresses but Ray's own core-worker server (on every interface in Ray 2.60; docs/operations.md says how
to firewall it). Runs in its own namespaces (cluster_helpers)."""

import pytest

from engine import LLM, SamplingParams
from tests.cluster_helpers import (
    MAX_TOKENS,
    PRIVATE_ADDRESSES,
    PROMPT,
    RAY_WORKER_PORTS,
    isolation_unavailable,
    run_isolated,
)

pytestmark = pytest.mark.skipif(isolation_unavailable() is not None, reason=str(isolation_unavailable()))


def test_prefill_and_decode_pools_run_on_their_own_nodes_and_kv_crosses(tmp_path):
    seen = run_isolated("two_nodes", tmp_path / "two_nodes", timeout_s=300)

    nodes = seen["nodes"]
    assert len(nodes) == 2, nodes
    (prefill_node,) = [n for n, res in nodes.items() if res.get("prefill_node") == 4]
    (decode_node,) = [n for n, res in nodes.items() if res.get("decode_node") == 4]
    assert prefill_node != decode_node
    placed = {}
    for actor in seen["actors"]:
        placed.setdefault(actor["class_name"], set()).add(actor["node_id"])
    assert placed == {"prefill": {prefill_node}, "decode": {decode_node}}, placed
    assert seen["groups"] == {"pdserve-prefill": [prefill_node], "pdserve-decode": [decode_node]}

    want = LLM("tiny").generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    got = seen["completion"]
    assert (got["text"], got["completion_tokens"], got["finish_reason"]) == (want[0].text, MAX_TOKENS, "length")
    transfer = seen["transfer"]
    # the KV crossed: pushed by the prefill worker (prefill_pool.kv_push) or pulled by the decode worker
    moved = transfer.get("pdserve_transfer_write_bytes", 0) + transfer.get("pdserve_transfer_read_bytes", 0)
    assert moved > 0, transfer
    assert transfer["pdserve_transfer_failures_total"] == 0, transfer

    # each worker listens on its node's private address (its KV agent's notifications and UCX's TCP transport on
    # the devices named, its output stream); nothing of ours on every interface: Ray's core-worker server only
    listening = [tuple(entry) for entry in seen["listening"]]
    by_worker = {pid: [entry for entry in listening if entry[2] == pid] for pid in {a["pid"] for a in seen["actors"]}}
    assert all(any(addr in PRIVATE_ADDRESSES for addr, *_ in entries) for entries in by_worker.values()), listening
    low, high = RAY_WORKER_PORTS
    stray = [entry for entry in listening if entry[0] not in PRIVATE_ADDRESSES and not low <= entry[1] <= high]
    assert not stray, stray

    # SIGTERM drains, then uvicorn re-raises the signal into Ray's driver handler, which exits with 15
    assert seen["server_exit"] in (0, 15), seen["server_exit"]
    assert seen["left_running"] == [], "ray stop left processes running"
