"""A two-node Ray cluster on one machine: a head started with `--resources '{"prefill_node": 4}'`, a second
`ray start --address` node with `{"decode_node": 4}`, and `pdserve serve --ray-address auto` whose pools ask for
those resources. Ray reports every prefill worker on the head and every decode worker on the other node, and a
streamed completion equals the single engine's greedy output, so the prompt's KV crossed from one node to the
other (the decode worker continues from it without recomputing). Runs in its own namespaces (cluster_helpers)."""

import pytest

from engine import LLM, SamplingParams
from tests.cluster_helpers import MAX_TOKENS, PROMPT, isolation_unavailable, run_isolated

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

    # SIGTERM drains, then uvicorn re-raises the signal into Ray's driver handler, which exits with 15
    assert seen["server_exit"] in (0, 15), seen["server_exit"]
    assert seen["left_running"] == [], "ray stop left processes running"
