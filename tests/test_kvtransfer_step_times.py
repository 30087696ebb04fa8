"""Where an agent's start and a peer's connection spend their time (kvtransfer.step_times): the steps a KV agent
records as it starts and registers its cache, and those of add_remote (a real peer over real ucxx), first
connection and replacement; the helper's own arithmetic and line."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvtransfer import AgentConfig, KVAgent
from kvtransfer.metadata import AgentMetadata
from kvtransfer.step_times import StepTimes, maybe_step
from tests.kvtransfer_helpers import SPEC, PeerProcess, random_cache

pytestmark = pytest.mark.timeout(200)

CONFIG = {"staging_bytes": 64 * SPEC.block_bytes, "timeout_s": 30.0}


def test_steps_are_listed_in_order_and_kept_when_the_step_raises() -> None:
    steps = StepTimes()
    with steps.step("a"):
        pass
    with pytest.raises(RuntimeError), steps.step("b"):
        raise RuntimeError("boom")
    steps.add("c", 0.25)
    more = StepTimes()
    more.add("d", 0.5)
    steps.extend(more, prefix="x.")
    with maybe_step(None, "e"):  # nobody times: nothing recorded, nothing raised
        pass
    assert [name for name, _ in steps.steps] == ["a", "b", "c", "x.d"]
    assert steps.total_s >= 0.75
    assert str(steps).endswith("c 0.250 s, x.d 0.500 s")
    assert str(StepTimes()) == "none"


def test_an_agents_start_and_its_connections_report_their_steps() -> None:
    agent = KVAgent("timed", AgentConfig(**CONFIG), address="127.0.0.1")
    peer = PeerProcess("timed-peer", num_blocks=16, seed=5, config=CONFIG)
    try:
        agent.register_cache(random_cache(SPEC, 16, seed=4), SPEC)
        assert [name for name, _ in agent.start_steps.steps] == [
            "loop_thread", "ucx_context", "ucx_listen", "notify_listen", "cache_views", "ipc_export", "cache_info"]
        assert all(s >= 0 for _, s in agent.start_steps.steps)

        steps = StepTimes()
        meta = peer.ready().meta
        assert agent.add_remote(meta, steps) == "timed-peer"
        # over ucx on the CPU: no CUDA IPC mapping
        assert [name for name, _ in steps.steps] == ["check", "loop_wait", "ucx_endpoint", "ucx_hello"]

        again = StepTimes()
        agent.add_remote(meta, again)  # the same metadata: a no-op, after its check
        assert [name for name, _ in again.steps] == ["check", "loop_wait"]

        # a new agent under the same name (a replacement's metadata): the old remote is dropped first
        successor = dataclasses.replace(AgentMetadata.from_bytes(meta), pid=-1)
        replaced = StepTimes()
        agent.add_remote(successor, replaced)
        assert [name for name, _ in replaced.steps][:3] == ["check", "loop_wait", "drop_old"]
        assert "ucx_hello" in [name for name, _ in replaced.steps]
    finally:
        peer.close()
        agent.close()



def test_an_agent_made_ahead_on_a_thread_is_the_one_started_and_its_failure_is_the_starts(monkeypatch) -> None:
    from kvtransfer import worker_setup

    ahead = worker_setup.begin_agent("made-ahead", AgentConfig(**CONFIG))
    agent = worker_setup.start_agent("made-ahead", AgentConfig(**CONFIG), random_cache(SPEC, 4, seed=1), SPEC,
                                     ahead=ahead)
    peer = PeerProcess("ahead-peer", num_blocks=16, seed=5, config=CONFIG)
    try:
        assert agent is ahead.result()
        assert [name for name, _ in agent.start_steps.steps][:2] == ["loop_thread", "ucx_context"]
        assert agent.add_remote(peer.ready().meta) == "ahead-peer"  # its UCX context serves this process's loop
    finally:
        peer.close()
        agent.close()

    # a worker whose engine failed to start discards the agent it made ahead: closed once made
    spare = worker_setup.begin_agent("discarded", AgentConfig(**CONFIG))
    worker_setup.discard_agent(spare)
    made = spare.result(timeout=60)
    deadline = time.monotonic() + 60
    while not made._closed and time.monotonic() < deadline:  # the callback may still be running on its thread
        time.sleep(0.01)
    assert made._closed

    def fails(name, config):
        raise OSError(f"agent {name}: cannot listen")
    monkeypatch.setattr(worker_setup, "KVAgent", fails)
    bad = worker_setup.begin_agent("bad", AgentConfig(**CONFIG))
    with pytest.raises(OSError, match="agent bad: cannot listen"):  # raised where start_agent is called
        worker_setup.start_agent("bad", AgentConfig(**CONFIG), random_cache(SPEC, 4, seed=1), SPEC, ahead=bad)
