"""Pools that scale, in parts: the config keys (coordinator.config.scaling_config, PoolConfig's min_workers /
max_workers), the policy's rules on given numbers (coordinator.backend.scale_policy: a miss confirmed, the pool that
misses furthest, max_workers, cooldown, a load low for scale_in_after_s, the busy band, min_workers), and a new
worker's room on a real local Ray (coordinator.backend.slot_placement: placed when there is room; no room on a Ray
pdserve started gives up at once; on a joined cluster the autoscaler is asked for the fleet with the worker in it, and
after placement_timeout_s the group is removed and the request set back). The whole on the real server:
tests/test_pool_scaling.py."""

import asyncio
import json
import math

import pytest
import ray
import yaml

from coordinator.backend.scale_policy import CONFIRM, PoolView, ScalePolicy
from coordinator.config.adaptive_config import SLOConfig
from coordinator.config.scaling_config import ScalingConfig
from coordinator.config.serve_config import load_serve_config
from coordinator.observability.latency_window import LatencyWindow
from engine.config_error import ConfigError

SLO = SLOConfig(ttft_ms=500, tpot_ms=40)
SCALING = ScalingConfig(window_s=10, min_requests=4, cooldown_s=5, scale_in_after_s=20, scale_in_busy=0.3)


def _load(tmp_path, raw: dict):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_serve_config(path)


SCALES = {"decode": {"workers": 1, "max_workers": 3}, "slo": {"ttft_ms": 500, "tpot_ms": 40}}


@pytest.mark.parametrize("raw, message", [
    ({"decode": {"workers": 1, "max_workers": 3}}, "pool 'decode' scales .* it needs 'slo'"),
    ({"decode": {"workers": 2, "min_workers": 3}}, r"decode: min_workers must be in \[1, workers \(2\)\], got 3"),
    ({"decode": {"workers": 2, "min_workers": 0}}, r"decode: min_workers must be in \[1, workers \(2\)\], got 0"),
    ({"prefill": {"workers": 2, "max_workers": 1}}, r"prefill: max_workers must be in \[workers \(2\), 256\], got 1"),
    ({"decode": {"max_workers": "3"}}, "'decode.max_workers' must be int"),
    ({"scaling": {"cooldown_s": 5}}, "'scaling' applies only to a pool whose min_workers or max_workers differs"),
    ({**SCALES, "scaling": {"scale_in_busy": 1.5}}, r"scaling: scale_in_busy must be a number in \(0, 1\]"),
    ({**SCALES, "scaling": {"placement_timeout_s": 0}}, "scaling: placement_timeout_s must be a number in"),
    ({**SCALES, "scaling": {"min_requests": 0}}, "scaling: min_requests must be an integer >= 1"),
    ({**SCALES, "scaling": {"grow_by": 2}}, "unknown key 'scaling.grow_by'"),
    ({"mode": "collocated", "prefill": {"max_workers": 2}, "slo": {"ttft_ms": 500, "tpot_ms": 40}},
     "'prefill.max_workers': mode collocated runs the decode pool only"),
    ({"slo": {"ttft_ms": 500, "tpot_ms": 40}}, "'slo' applies to mode: adaptive only .* or to pools that scale"),
])
def test_bad_scaling_keys_fail_at_load_naming_the_key(tmp_path, raw, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, raw)


def test_a_pool_scales_only_where_its_sizes_differ_from_workers(tmp_path):
    plain = _load(tmp_path, {"decode": {"workers": 2, "min_workers": 2, "max_workers": 2}})
    assert plain.scaling_pools == () and plain.decode.fewest == plain.decode.most == 2
    config = _load(tmp_path, {**SCALES, "prefill": {"workers": 2, "min_workers": 1}, "scaling": {"cooldown_s": 5}})
    assert config.scaling_pools == ("prefill", "decode") and config.scaling.cooldown_s == 5
    assert (config.prefill.fewest, config.prefill.most, config.decode.fewest, config.decode.most) == (1, 2, 1, 3)
    assert _load(tmp_path, {**SCALES, "mode": "collocated"}).scaling_pools == ("decode",)


# ---- the policy
def _window(now: float, n: int, ttft_s: float, tpot_s: float) -> LatencyWindow:
    window = LatencyWindow(60)
    for i in range(n):
        window.add(now - 0.5 + i * 0.01, ttft_s, tpot_s)
    return window


def _pool(name: str = "decode", slots: int = 1, most: int = 3, fewest: int = 1, busy: list[float] | None = None,
          live: int | None = None) -> PoolView:
    return PoolView(name, slots, slots if live is None else live, fewest, most,
                    [0.9] * slots if busy is None else busy)


def test_a_pool_that_misses_its_target_on_confirmed_looks_grows_up_to_max_workers():
    policy, now = ScalePolicy(SCALING, SLO, collocated=False), 100.0
    slow = _window(now, 8, 0.1, 0.060)  # TPOT p90 60 ms against 40: decode misses; TTFT within its target
    for look in range(1, CONFIRM):
        assert policy.look(now + look, slow, [_pool("prefill"), _pool()]) is None  # not confirmed yet
    decision = policy.look(now + CONFIRM, slow, [_pool("prefill"), _pool()])
    assert (decision.pool, decision.direction) == ("decode", "out")
    assert "TPOT p90 60.0 ms (target 40)" in decision.why and "over 8 requests" in decision.why
    at_max = ScalePolicy(SCALING, SLO, collocated=False)
    assert all(at_max.look(now + i, slow, [_pool(slots=3)]) is None for i in range(5))
    few = ScalePolicy(SCALING, SLO, collocated=False)  # fewer than min_requests: nothing misses
    assert all(few.look(now + i, _window(now, 3, 0.1, 0.06), [_pool()]) is None for i in range(5))


def test_the_pool_that_misses_furthest_grows_and_collocated_judges_both_targets():
    both = _window(100, 8, 1.5, 0.060)  # TTFT 3x its target, TPOT 1.5x
    policy = ScalePolicy(SCALING, SLO, collocated=False)
    decisions = [policy.look(100 + i, both, [_pool("prefill"), _pool()]) for i in range(CONFIRM)]
    assert decisions[-1].pool == "prefill"
    grown = ScalePolicy(SCALING, SLO, collocated=False)  # prefill is at its max: decode, which misses too, grows
    decisions = [grown.look(100 + i, both, [_pool("prefill", slots=2, most=2), _pool()]) for i in range(CONFIRM)]
    assert decisions[-1].pool == "decode"
    collocated = ScalePolicy(SCALING, SLO, collocated=True)  # one pool: a TTFT miss alone grows it
    decisions = [collocated.look(100 + i, _window(100, 8, 0.9, 0.010), [_pool()]) for i in range(CONFIRM)]
    assert (decisions[-1].pool, decisions[-1].direction) == ("decode", "out")


def test_after_an_event_the_cooldown_passes_and_only_later_requests_are_judged():
    policy, now = ScalePolicy(SCALING, SLO, collocated=False), 100.0
    slow = _window(now, 8, 0.1, 0.060)
    policy.acted(now)
    for t in (now + 1, now + 2, now + 3):
        assert policy.look(t, slow, [_pool()]) is None  # the requests judged ended before the event
    later = _window(now + 4, 8, 0.1, 0.060)
    assert [policy.look(t, later, [_pool()]) for t in (now + 4, now + 4.5)] == [None, None]  # cooldown (5 s)
    assert policy.look(now + 5, later, [_pool()]).direction == "out"


def test_a_pool_shrinks_after_its_load_stayed_low_never_below_min_workers_with_a_busy_band():
    quiet = LatencyWindow(60)  # no request ended: nothing to judge, nothing missed
    policy, now = ScalePolicy(SCALING, SLO, collocated=False), 1000.0
    idle = _pool(slots=3, busy=[0.05, 0.0, 0.1])
    assert policy.look(now, quiet, [idle]) is None
    assert policy.look(now + 19, quiet, [idle]) is None  # low, but not for scale_in_after_s yet
    decision = policy.look(now + 20, quiet, [idle])
    assert (decision.pool, decision.direction) == ("decode", "in")
    assert "stayed low for 20 s" in decision.why and "busy 5% of the time" in decision.why

    def shrinks(pool: PoolView, window: LatencyWindow = quiet) -> bool:
        fresh = ScalePolicy(SCALING, SLO, collocated=False)
        return any(fresh.look(now + t, window, [pool]) is not None for t in range(0, 60, 5))
    assert not shrinks(_pool(slots=1, busy=[0.0]))                  # at min_workers
    assert not shrinks(_pool(slots=2, fewest=2, busy=[0.0, 0.0]))   # min_workers 2
    assert not shrinks(_pool(slots=2, busy=[0.2, 0.2]))  # 0.4 of a worker's time on the one left: over 0.3
    assert shrinks(_pool(slots=3, busy=[0.2, 0.2, 0.15]))  # 0.55 over 2 workers: 0.275
    assert not shrinks(_pool(slots=2, busy=[0.0]))                  # one worker not measured yet
    assert not shrinks(_pool(slots=2, live=1, busy=[0.0]))          # one slot not live (replaced, drained)
    assert not shrinks(_pool(slots=2, busy=[0.0, 0.0]), _window(now + 55, 8, 0.1, 0.035))  # TPOT near its target


def test_a_low_streak_starts_again_when_the_load_comes_back():
    policy, now, quiet = ScalePolicy(SCALING, SLO, collocated=False), 0.0, LatencyWindow(60)
    idle, busy = _pool(slots=2, busy=[0.0, 0.0]), _pool(slots=2, busy=[0.9, 0.9])
    assert policy.look(now, quiet, [idle]) is None
    assert policy.look(now + 15, quiet, [busy]) is None
    assert policy.look(now + 25, quiet, [idle]) is None  # low again since 25: 20 s from then
    assert policy.look(now + 44, quiet, [idle]) is None
    assert policy.look(now + 45, quiet, [idle]).direction == "in"
    assert math.isinf(ScalePolicy(SCALING, SLO, collocated=False).last_event)


def test_the_scaler_reads_the_same_single_machine_switch_that_pdserve_serve_sets():
    from coordinator.backend.ray_network import RAY_CLUSTERS_ENV as SET
    from coordinator.backend.ray_network import confine_local_ray
    from coordinator.backend.slot_placement import RAY_CLUSTERS_ENV, single_machine
    environ: dict[str, str] = {}
    assert RAY_CLUSTERS_ENV == SET and not single_machine(environ)
    confine_local_ray(environ)
    assert single_machine(environ)


# ---- a new worker's room, on a real local Ray
@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, resources={"pdserve_slot": 1}, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _groups_alive() -> list[str]:
    return [g["name"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def _standing_request() -> list[dict]:
    """The autoscaler's standing resource request (what request_resources set last)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    if is_autoscaler_v2():
        from ray._private.worker import global_worker
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        state = get_cluster_resource_state(global_worker.gcs_client)
        return [dict(b.resources_bundle) for c in state.cluster_resource_constraints
                for r in c.resource_requests for b in [r.request] * r.count]
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get
    return json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"[]")


def test_a_new_worker_is_placed_where_there_is_room_and_gives_up_cleanly_where_there_is_none(local_ray):
    from ray.util.placement_group import remove_placement_group

    from coordinator.backend.slot_placement import NoRoom, place
    bundle = {"CPU": 0.5, "pdserve_slot": 1}
    group = asyncio.run(place(bundle, "pdserve-decode-slot-1", "PACK", joined=False, timeout_s=60, fleet=[]))
    assert "pdserve-decode-slot-1" in _groups_alive()
    with pytest.raises(NoRoom, match=r"the Ray cluster has no room for it: a worker needs \{'CPU': 0.5, "
                       r"'pdserve_slot': 1\}, the cluster has \{'CPU': 0.5, 'pdserve_slot': 0.0\} free; this Ray "
                       "was started by pdserve itself .* no autoscaler can add a node"):
        asyncio.run(place(bundle, "pdserve-decode-slot-2", "PACK", joined=False, timeout_s=60, fleet=[bundle]))
    assert _groups_alive() == ["pdserve-decode-slot-1"]  # nothing left of the attempt
    # a joined cluster: the autoscaler is asked for the fleet and the new worker, then (no node came) set back
    with pytest.raises(NoRoom, match=r"no room for it came within scaling.placement_timeout_s \(2 s\): a worker needs "
                       r".*Ray's autoscaler was asked for it"):
        asyncio.run(place(bundle, "pdserve-decode-slot-2", "PACK", joined=True, timeout_s=2, fleet=[bundle]))
    assert _groups_alive() == ["pdserve-decode-slot-1"]
    assert _standing_request() == [bundle]  # the fleet as it is
    remove_placement_group(group)
