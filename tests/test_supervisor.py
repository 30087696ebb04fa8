"""Supervisor: a dead worker is marked once, its slot is refilled at once the first time and then after a backoff that
doubles with each recent restart, a failed start is retried, and past max_restarts the slot stays down instead of
crash-looping. The pool here starts slots with a stand-in (no actors); the real replacement runs end to end in
test_self_healing.py."""

import asyncio

from coordinator.admission.router import WorkerState
from coordinator.backend.pools import Pools
from coordinator.backend.supervisor import Supervisor, restart_delay
from coordinator.config.serve_config import RecoveryConfig, ServeConfig
from engine.load import WorkerInfo


class _Slots(Pools):
    """Pools whose start_slot makes a WorkerState without an actor, failing the first `fail` starts."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__(ServeConfig())
        self.fail, self.starts, self.connected = fail, [], []

    async def start_slot(self, role: str, index: int, incarnation: int = 0, current_role: str = "") -> WorkerState:
        self.starts.append((role, index, incarnation))
        if len(self.starts) <= self.fail:
            raise RuntimeError("the model did not load")
        return WorkerState(_info(f"{role}-{index}", role), handle=None, incarnation=incarnation, role=current_role)

    async def connect(self, worker: WorkerState) -> None:
        self.connected.append(worker.key)

    async def disconnect(self, dead: WorkerState) -> None:
        self.connected.append(f"-{dead.key}")


def _info(name: str, role: str) -> WorkerInfo:
    return WorkerInfo(name, role, 100, 16, 4096, 1000, b"meta", (("engine", 1.5), ("agent", 0.25)))


def _supervised(pools: _Slots, **recovery) -> tuple[Supervisor, list, list]:
    pools.prefill = [WorkerState(_info("prefill-0", "prefill"), handle=None)]
    pools.decode = [WorkerState(_info("decode-0", "decode"), handle=None)]
    dead, live = [], []
    config = RecoveryConfig(backoff_initial_s=0.01, backoff_max_s=0.04, **recovery)
    return Supervisor(pools, config, lambda w, reason: dead.append((w.key, reason)), lambda w: live.append(w.key)), \
        dead, live


def test_a_dead_worker_is_replaced_in_its_slot_and_health_follows():
    pools = _Slots()
    sup, dead, live = _supervised(pools)

    async def run():
        assert sup.healthy()
        old = pools.decode[0]
        sup.worker_died(old, "actor died")
        sup.worker_died(old, "again")  # once per incarnation
        assert not sup.healthy() and sup.down_reason("decode") == \
            "the decode pool has no live worker (decode-0 dead: a replacement is being started)"
        while not live:
            await asyncio.sleep(0.005)
        new = pools.decode[0]
        assert new is not old and new.incarnation == 1 and new.alive and old.state == "restarting"
        assert sup.healthy() and sup.restarts == {"decode-0": 1} and pools.connected == ["-decode-0#0", "decode-0#1"]
        assert dead == [("decode-0#0", "actor died")] and live == ["decode-0#1"]
        states = {s["name"]: s for s in sup.states()}
        assert states["decode-0"]["state"] == "live" and states["decode-0"]["restarts"] == 1
        phases = states["decode-0"]["last_recovery_s"]
        assert phases["engine_s"] == 1.5 and phases["agent_s"] == 0.25 and phases["total_s"] >= phases["backoff_s"]
        assert sup.downtime_s()["decode"] > 0 and sup.downtime_s()["prefill"] == 0
    asyncio.run(run())


def test_the_first_replacement_starts_at_once_then_the_backoff_doubles():
    config = RecoveryConfig(backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [restart_delay(n, config) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    # through the supervisor: a backoff far past the test's patience, yet the first death is replaced
    pools = _Slots()
    sup = Supervisor(pools, RecoveryConfig(backoff_initial_s=3600.0, backoff_max_s=3600.0), lambda w, r: None,
                     lambda w: None)
    pools.decode = [WorkerState(_info("decode-0", "decode"), handle=None)]

    async def run():
        sup.worker_died(pools.decode[0], "killed")
        while not pools.connected or pools.connected[-1] != "decode-0#1":
            await asyncio.sleep(0.005)
        await sup.shutdown()
    asyncio.run(asyncio.wait_for(run(), 60))
    assert pools.starts == [("decode", 0, 1)]


def test_failed_starts_are_retried_with_doubling_backoff_until_the_limit():
    pools = _Slots(fail=10)
    sup, _, live = _supervised(pools, max_restarts=3)

    async def run():
        sup.worker_died(pools.prefill[0], "killed")
        while pools.prefill[0].state != "failed":
            await asyncio.sleep(0.005)
        await sup.shutdown()
    asyncio.run(run())
    assert pools.starts == [("prefill", 0, 1), ("prefill", 0, 2), ("prefill", 0, 3)]  # then it gives up
    assert live == [] and sup.restart_failures == {"prefill-0": 3} and not sup.healthy()
    assert "replacement failed to start: RuntimeError: the model did not load" in sup.reasons["prefill-0"]
    # it says it gave up, not that a replacement is coming
    reason = sup.down_reason("prefill")
    assert "prefill-0 failed: gave up after 3 restarts within 600 s (recovery.max_restarts 3)" in reason, reason
    assert "no replacement is being started" in reason and "POST /admin/workers/prefill-0/revive" in reason
    assert "being started until" in reason and "a replacement is being started" not in reason
    state = next(s for s in sup.states() if s["name"] == "prefill-0")
    assert state["state"] == "failed" and state["gave_up"].startswith("gave up after 3 restarts"), state


def test_a_slot_that_gave_up_is_revived_with_a_fresh_count_and_only_then():
    pools = _Slots(fail=3)
    sup, _, live = _supervised(pools, max_restarts=2)

    async def run():
        assert sup.revive("decode-0") is False and sup.revive("nobody") is None  # live: nothing to revive
        sup.worker_died(pools.decode[0], "killed")
        while pools.decode[0].state != "failed":
            await asyncio.sleep(0.005)
        assert len(pools.starts) == 2 and "decode-0" in sup.gave_up
        assert sup.revive("decode-0") is True  # the 3rd start fails too: counted afresh, so a 4th is tried
        while not live:
            await asyncio.sleep(0.005)
        assert sup.revive("decode-0") is False
    asyncio.run(run())
    assert [s[2] for s in pools.starts] == [1, 2, 3, 4] and live == ["decode-0#4"] and sup.gave_up == {}
    assert "gave_up" not in next(s for s in sup.states() if s["name"] == "decode-0")


def test_a_planned_restart_starts_at_once_and_is_not_counted_against_max_restarts():
    pools = _Slots()
    sup, dead, live = _supervised(pools, max_restarts=1)

    async def run():
        for n in range(1, 4):  # three on purpose with max_restarts 1: none gives up
            old = sup.restart("decode-0", "rolling restart")
            assert old is not None and old.incarnation == n - 1
            while len(live) < n:
                await asyncio.sleep(0.005)
        assert sup.restart("nobody", "x") is None
    asyncio.run(run())
    assert live == ["decode-0#1", "decode-0#2", "decode-0#3"] and pools.decode[0].alive
    assert [reason for _, reason in dead] == ["rolling restart"] * 3
    assert sup.planned(pools.decode[0]) is False  # the live one; each replaced one was


def test_a_start_that_fails_once_is_retried_and_the_slot_comes_back():
    pools = _Slots(fail=1)
    sup, _, live = _supervised(pools)

    async def run():
        sup.worker_died(pools.decode[0], "killed")
        while not live:
            await asyncio.sleep(0.005)
    asyncio.run(run())
    assert pools.starts == [("decode", 0, 1), ("decode", 0, 2)] and pools.decode[0].incarnation == 2
    assert live == ["decode-0#2"] and sup.restart_failures == {"decode-0": 1}
