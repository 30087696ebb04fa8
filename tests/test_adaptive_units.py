"""The adaptive layout's decisions on made-up figures: the placement model (coordinator.admission.placement), the
planner's verdict, its ladder of roles, hysteresis and cooldown (coordinator.backend.planner), and the config's
checks (mode adaptive needs an SLO; the SLO and planner belong to it alone)."""

import math
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from coordinator.admission.placement import PlacementModel, Side
from coordinator.admission.router import HOST_HIT_VALUE, Router, WorkerState
from coordinator.backend.planner import Planner, lane_share, step_toward, verdict
from coordinator.config.adaptive_config import PlannerConfig, SLOConfig
from coordinator.config.serve_config import load_serve_config
from coordinator.observability.latency_window import LatencyWindow
from engine.config_error import ConfigError
from engine.core.block_manager import prefix_block_hashes
from engine.load import EngineLoad, WorkerInfo

SLO = SLOConfig(ttft_ms=500, tpot_ms=40)


def _load(per_token_s: float, budget: int = 512, step_s: float = 0.010, running: int = 0) -> EngineLoad:
    return EngineLoad(0, 0, running, 0, 100, 100, prefill_budget_tokens=budget, decode_step_s=step_s,
                      prefill_token_s=per_token_s)


def test_an_idle_prefill_worker_takes_the_prompt_remote():
    model = PlacementModel(SLO)
    local = Side("decode-0", _load(30e-6, running=40), 0, 2000, decoding=True)
    remote = Side("prefill-0", _load(30e-6), 0, 2000, decoding=False)
    choice = model.choose(local, [remote])
    assert choice.placement == "remote" and choice.remote_s == pytest.approx(0.06)


def test_a_long_remote_queue_sends_the_prompt_local():
    model = PlacementModel(SLO)
    local = Side("decode-0", _load(30e-6, budget=700, step_s=0.010, running=40), 0, 2000, decoding=True)
    remote = Side("prefill-0", _load(30e-6), 40_000, 2000, decoding=False)  # 1.26 s of prompts queued
    choice = model.choose(local, [remote])
    # local: 3 decoding steps of (10 ms + 700 x 30 us) = 93 ms, against 1.26 s remote
    assert choice.placement == "local"
    assert choice.local_s == pytest.approx(0.093) and choice.remote_s == pytest.approx(1.26)


def test_a_decoding_worker_with_a_prefill_lane_is_priced_at_the_lanes_rate():
    """A prefill lane (sm_split_decode_sms) runs prompts beside the decode steps: a local prefill costs the lane's
    measured seconds per token, even where the step budget leaves no room for prompt tokens in the steps."""
    model = PlacementModel(SLO)
    crowded = _load(30e-6, budget=64, step_s=0.039, running=60)  # 39 ms + 64 x 30 us > the 40 ms target
    assert model.choose(Side("decode-0", crowded, 0, 2000, decoding=True),
                        [Side("prefill-0", _load(30e-6), 40_000, 2000, decoding=False)]).local_s == math.inf
    lane = EngineLoad(0, 0, 60, 0, 100, 100, prefill_budget_tokens=64, decode_step_s=0.039, prefill_token_s=30e-6,
                      lane_token_s=50e-6)
    choice = model.choose(Side("decode-0", lane, 1000, 2000, decoding=True),
                          [Side("prefill-0", _load(30e-6), 40_000, 2000, decoding=False)])
    assert choice.placement == "local" and choice.local_s == pytest.approx(0.15)  # 3,000 tokens x 50 us


def test_remote_wins_within_its_comfort_even_when_local_is_quicker():
    model = PlacementModel(SLO)
    local = Side("decode-0", _load(10e-6), 0, 1000, decoding=False)       # 10 ms
    remote = Side("prefill-0", _load(30e-6), 5000, 1000, decoding=False)  # 180 ms: within half of 500 ms
    assert model.choose(local, [remote]).placement == "remote"


def test_the_measured_handoff_counts_against_remote():
    model = PlacementModel(SLO)
    for _ in range(100):
        model.observe_transfer(1000, 0.5)  # 500 us per token: a slow link
    local = Side("decode-0", _load(30e-6), 0, 1000, decoding=False)
    remote = Side("prefill-0", _load(30e-6), 0, 1000, decoding=False)
    choice = model.choose(local, [remote])
    assert choice.placement == "local" and choice.remote_s == pytest.approx(0.53, rel=0.01)


def test_without_a_remote_worker_or_any_figure_the_rule_still_answers():
    model = PlacementModel(SLO)
    assert model.choose(Side("d", None, 0, 10, False), []).placement == "local"
    unknown = model.choose(Side("d", None, 0, 10, False), [Side("p", None, 0, 10, False)])
    assert unknown.placement == "remote" and math.isinf(unknown.local_s)  # nothing measured: disaggregate


def test_the_router_remembers_prefixes_per_worker():
    router = Router(block_size=4)
    tokens = list(range(20))
    router.remember(tokens, "decode-0")
    router.remember(tokens[:8], "prefill-0")
    assert router.cached_tokens(tokens + [99], "decode-0") == 20
    assert router.cached_tokens(tokens, "prefill-0") == 8
    assert router.cached_tokens([7] + tokens, "decode-0") == 0


def test_a_whole_request_goes_where_its_prefix_is_while_room_allows():
    """Collocated (Router.pick_whole): a prompt whose leading blocks a worker computed goes back to it, though
    the other has more room, until that room is more than affinity_slack_tokens short; a new prompt goes to the
    roomiest; nothing goes where it does not fit."""
    router = Router(block_size=4, affinity_slack_tokens=40)  # slack: 10 blocks
    a, b = _workers("decode", "decode")
    rooms = {a.name: 100, b.name: 100}
    turn1 = list(range(20))
    first = router.pick_whole(turn1, [a, b], lambda w: rooms[w.name], 5)
    other = b if first is a else a
    rooms[first.name] -= 5
    turn2 = turn1 + list(range(100, 108))
    assert router.pick_whole(turn2, [a, b], lambda w: rooms[w.name], 7) is first  # 95 against 100: within slack
    assert router.affinity_hits == 1
    rooms[first.name] = 80
    assert router.pick_whole(turn2 + [1], [a, b], lambda w: rooms[w.name], 7) is other  # 20 blocks short
    assert router.pick_whole(list(range(500, 520)), [a, b], lambda w: rooms[w.name], 5) is other  # no owner
    assert router.pick_whole(turn2, [a, b], lambda w: rooms[w.name], 101) is None


def test_verdict():
    assert verdict(0.1, 0.039, SLO) == "decode"      # TPOT at 97% of its target, TTFT with room
    assert verdict(0.49, 0.010, SLO) == "prefill"    # the other way round
    assert verdict(0.49, 0.039, SLO) is None         # both short: moving either way hurts the other
    assert verdict(0.49, 0.030, SLO) == "prefill"    # decode not short (within 90% of its target)
    assert verdict(0.1, 0.010, SLO) is None          # neither
    assert verdict(math.nan, 0.039, SLO) is None


def _workers(*roles: str) -> list[WorkerState]:
    out = []
    for i, role in enumerate(roles):
        info = WorkerInfo(f"w-{i}", role if role != "mixed" else "decode", 100, 16, 1024, 100, None)
        out.append(WorkerState(info, None, role=role, load=_load(30e-6)))  # idle: its step time does not grow
    return out


def test_the_ladder_moves_one_step_and_keeps_a_decoder():
    idle = {"w-0": 0.2, "w-1": 0.2}
    ws = _workers("prefill", "decode")
    assert [(w.name, r) for w, r in [step_toward("decode", ws, lambda w: 0, idle)]] == [("w-0", "mixed")]
    ws = _workers("mixed", "decode")
    assert step_toward("decode", ws, lambda w: 0, idle)[1] == "decode"
    assert step_toward("prefill", ws, lambda w: 0, idle) == (ws[0], "prefill")
    ws = _workers("mixed")  # the only decoder may not stop decoding
    assert step_toward("prefill", ws, lambda w: 0, idle) is None
    ws = _workers("prefill", "decode")
    assert step_toward("prefill", ws, lambda w: 0, idle) == (ws[1], "mixed")


def test_a_busy_prefill_worker_does_not_take_decodes():
    """Its prompts would share decoding steps within their budget: the prefill rate the pool lives on is lost (on
    2 H200s at 24 req/s under 2000/15 ms, such a move cut goodput from 10.5 to 4.4 req/s)."""
    ws = _workers("prefill", "decode")
    assert step_toward("decode", ws, lambda w: 0, {"w-0": 0.95}) is None
    assert step_toward("decode", ws, lambda w: 0, {}) is None  # not measured yet: counted busy
    ws = _workers("prefill", "mixed", "decode")
    assert step_toward("decode", ws, lambda w: 0, {"w-0": 0.95}) == (ws[1], "decode")


def _with_lane(worker: WorkerState, lane_token_s: float) -> WorkerState:
    """The worker's load as one with a prefill lane measured at `lane_token_s` (its full rate: 30 us a token)."""
    worker.load = replace(worker.load, lane_token_s=lane_token_s)
    return worker


def test_short_prefill_moves_a_decode_worker_with_a_lane_to_mixed_before_any_worker_stops_decoding():
    """Its prompts run on the lane beside its steps; a mixed worker turned prefill would stop decoding instead."""
    idle = {"w-0": 0.2, "w-1": 0.2, "w-2": 0.2}
    ws = _workers("mixed", "decode", "decode")
    assert step_toward("prefill", ws, lambda w: 0, idle) == (ws[0], "prefill")  # no lane: the ladder as before
    _with_lane(ws[2], 50e-6)
    assert lane_share(ws[2]) == pytest.approx(0.6) and lane_share(ws[1]) == 0
    assert step_toward("prefill", ws, lambda w: 0, idle) == (ws[2], "mixed")
    ws[2].load = replace(ws[2].load, prefill_token_s=0.0)  # the full rate not measured: no share known
    assert step_toward("prefill", ws, lambda w: 0, idle) == (ws[0], "prefill")


def test_a_busy_prefill_worker_with_a_lane_that_carries_its_prompts_takes_decodes():
    """A lane keeping 0.6 of the full prefill rate carries a worker busy 0.5 (0.83 of the lane's time, under
    LANE_FULL), not one busy 0.6 (1.0): that one's prompts would fall behind."""
    ws = _workers("prefill", "decode")
    assert step_toward("decode", ws, lambda w: 0, {"w-0": 0.5}) is None  # no lane: busy is not < SPARE
    _with_lane(ws[0], 50e-6)
    assert step_toward("decode", ws, lambda w: 0, {"w-0": 0.5}) == (ws[0], "mixed")
    assert step_toward("decode", ws, lambda w: 0, {"w-0": 0.6}) is None
    assert step_toward("decode", ws, lambda w: 0, {}) is None  # not measured yet: counted busy


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_planner_waits_for_a_confirmed_verdict_then_cools_down():
    clock, window = _Clock(), LatencyWindow(horizon_s=10)
    workers = _workers("prefill", "decode")
    changes = []

    def apply(w, role, why):
        changes.append((w.name, w.role, role))
        w.role = role
    planner = Planner(PlannerConfig(interval_s=1, cooldown_s=5, window_s=10, min_requests=4), SLO,
                      lambda: workers, window, apply, lambda w: 0, clock)
    for _ in range(4):
        window.add(clock.now, 0.05, 0.039)  # decode short
    assert planner.tick() is None            # first look: not confirmed yet
    clock.now += 1
    change = planner.tick()
    assert change is not None and (change.worker, change.old, change.new) == ("w-0", "prefill", "mixed")
    assert "decode is short" in change.why
    for _ in range(10):
        window.add(clock.now, 0.05, 0.039)
    clock.now += 1
    assert planner.tick() is None and planner.tick() is None  # cooling down
    clock.now += 5
    assert planner.tick() is None  # requests judged again, confirmed on the next look
    clock.now += 1
    assert planner.tick().new == "decode"
    assert changes == [("w-0", "prefill", "mixed"), ("w-0", "mixed", "decode")]


def test_the_planner_needs_enough_requests_and_a_steady_verdict():
    clock, window = _Clock(), LatencyWindow(horizon_s=10)
    workers = _workers("prefill", "decode")
    planner = Planner(PlannerConfig(interval_s=1, cooldown_s=0, window_s=10, min_requests=5), SLO,
                      lambda: workers, window, lambda w, r, why: setattr(w, "role", r), lambda w: 0, clock)
    for _ in range(4):
        window.add(clock.now, 0.05, 0.039)
    assert planner.tick() is None and planner.tick() is None  # 4 < min_requests
    window.add(clock.now, 0.45, 0.010)  # the p90 now says prefill is short: the verdict flips, no change
    assert planner.tick() is None
    assert [w.role for w in workers] == ["prefill", "decode"]


def test_no_live_decoder_makes_one_mixed_at_once():
    clock, window = _Clock(), LatencyWindow(horizon_s=10)
    workers = _workers("prefill", "decode")
    workers[1].state = "dead"
    planner = Planner(PlannerConfig(cooldown_s=100), SLO, lambda: workers, window,
                      lambda w, r, why: setattr(w, "role", r), lambda w: 0, clock)
    change = planner.tick()
    assert (change.worker, change.new) == ("w-0", "mixed") and workers[0].decodes
    workers[0].role, workers[1].state = "prefill", "live"  # and the moment the last decoder dies, without a look
    assert planner.ensure_decoder() is None
    workers[1].state = "dead"
    change = planner.ensure_decoder()
    assert (change.worker, change.new) == ("w-0", "mixed") and workers[0].decodes


def test_the_planner_measures_how_busy_each_engine_was():
    clock, window = _Clock(), LatencyWindow(horizon_s=10)
    workers = _workers("prefill", "decode")
    planner = Planner(PlannerConfig(), SLO, lambda: workers, window, lambda w, r, why: None, lambda w: 0, clock)
    planner.tick()
    clock.now += 2
    workers[0].load = EngineLoad(0, 0, 1, 0, 100, 100, step_time_total_s=1.8)  # stepped 1.8 s of the 2
    planner.tick()
    assert planner.busy == {"w-0": pytest.approx(0.9), "w-1": 0.0}



def test_busy_is_timed_by_the_reports_own_clock():
    """A prefill worker's report comes with its replies: a look that finds no newer one keeps the last figure
    (it once read 0% busy for a busy worker), and the share divides by the time between the reports."""
    clock, window = _Clock(), LatencyWindow(horizon_s=10)
    workers = _workers("prefill", "decode")
    planner = Planner(PlannerConfig(), SLO, lambda: workers, window, lambda w, r, why: None, lambda w: 0, clock)
    workers[0].load = EngineLoad(0, 0, 1, 0, 100, 100, step_time_total_s=10.0, taken_at_s=100.0)
    planner.tick()
    clock.now += 5
    workers[0].load = EngineLoad(0, 0, 1, 0, 100, 100, step_time_total_s=11.6, taken_at_s=102.0)  # 1.6 s of 2
    planner.tick()
    assert planner.busy["w-0"] == pytest.approx(0.8)
    clock.now += 5  # no newer report: the figure stands
    planner.tick()
    assert planner.busy["w-0"] == pytest.approx(0.8)

def _yaml(tmp_path, text: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


def test_adaptive_config_is_checked_at_load(tmp_path):
    good = load_serve_config(_yaml(tmp_path, "mode: adaptive\nslo: {ttft_ms: 800, tpot_ms: 25}\n"))
    assert good.adaptive and good.slo.tpot_s == 0.025
    assert good.engine_config(good.decode).decode_step_target_s == pytest.approx(0.025 * 0.85)
    with pytest.raises(ConfigError, match="mode adaptive needs 'slo'"):
        load_serve_config(_yaml(tmp_path, "mode: adaptive\n"))
    with pytest.raises(ConfigError, match=r"slo.*tpot_ms must be a number in \(0, 60000\]"):
        load_serve_config(_yaml(tmp_path, "mode: adaptive\nslo: {ttft_ms: 500, tpot_ms: 0}\n"))
    with pytest.raises(ConfigError, match="ttft_ms must be a number"):
        load_serve_config(_yaml(tmp_path, "mode: adaptive\nslo: {ttft_ms: .nan, tpot_ms: 40}\n"))
    with pytest.raises(ConfigError, match="unknown key 'slo.ttft'"):
        load_serve_config(_yaml(tmp_path, "mode: adaptive\nslo: {ttft: 500}\n"))
    with pytest.raises(ConfigError, match="'slo' applies to mode: adaptive only"):
        load_serve_config(_yaml(tmp_path, "mode: collocated\nslo: {ttft_ms: 500, tpot_ms: 40}\n"))
    with pytest.raises(ConfigError, match="'planner' applies to mode: adaptive only"):
        load_serve_config(_yaml(tmp_path, "planner: {interval_s: 1}\n"))
    with pytest.raises(ConfigError, match="same tensor_parallel_size"):
        load_serve_config(_yaml(tmp_path, "mode: adaptive\nslo: {ttft_ms: 500, tpot_ms: 40}\n"
                                          "prefill: {tensor_parallel_size: 2}\n"))
    assert load_serve_config("configs/adaptive.yaml").adaptive


@pytest.mark.parametrize("slo", ["{ttft_ms: 500}", "{tpot_ms: 40}", "{}"])
def test_pdserve_serve_refuses_an_slo_without_both_targets_at_load(tmp_path, slo):
    """A target left out was silently 40 ms (tpot) or 500 ms (ttft): `pdserve serve` now stops at load, naming
    the key, before it binds a port or starts Ray."""
    path = _yaml(tmp_path, f"model: tiny\nmode: adaptive\nslo: {slo}\nserver: {{port: 0}}\n")
    missing = "slo.ttft_ms" if "ttft" not in slo else "slo.tpot_ms"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # it started serving: stop it (a drain) before failing
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=120)
        pytest.fail(f"pdserve serve started with slo {slo}")
    assert proc.returncode == 2, err
    assert f"{path}: '{missing}' is required (it has no default)" in err, err


def test_a_decoder_without_headroom_takes_no_local_prompt_however_long_the_remote_queue():
    tight = SLOConfig(ttft_ms=2000, tpot_ms=15)  # decode steps may take 12.75 ms
    model = PlacementModel(tight)
    full = Side("decode-0", _load(28e-6, budget=64, step_s=0.014, running=60), 0, 2400, decoding=True)
    remote = Side("prefill-0", _load(28e-6), 100_000, 2400, decoding=False)  # ~2.9 s queued
    choice = model.choose(full, [remote])
    assert choice.placement == "remote" and math.isinf(choice.local_s)
    roomy = Side("decode-0", _load(28e-6, budget=64, step_s=0.010, running=60), 0, 2400, decoding=True)
    assert model.choose(roomy, [remote]).placement == "local"  # 38 steps of 11.8 ms: 0.45 s


def test_a_remote_side_slower_than_its_estimate_learns_it_and_loses_the_prompt():
    # The 2-H200 cell of docs/benchmark-log.md: remote first tokens came ~4x later than the model said.
    model = PlacementModel(SLO)
    local = Side("decode-0", _load(30e-6, budget=512, step_s=0.010, running=40), 0, 2000, decoding=True)
    remote = Side("prefill-0", _load(30e-6), 4_000, 2000, decoding=False)  # 0.18 s raw; local 4 steps, 0.10 s
    first = model.choose(local, [remote])
    assert first.placement == "remote" and first.worker == "prefill-0"  # 0.18 s is within half of 500 ms
    assert first.raw_s == pytest.approx(0.18)
    for _ in range(20):  # each remote placement's first token came after 0.72 s
        model.observe_first_token(first, 0.72)
    assert model.calibration.factor("prefill-0", "remote") == pytest.approx(4.0, rel=0.01)
    again = model.choose(local, [remote])
    assert again.placement == "local" and again.worker == "decode-0"
    assert again.remote_s == pytest.approx(0.72, rel=0.01) and again.raw_s == pytest.approx(again.local_s)
    # the local side learns too: a local first token 20x its estimate is clamped at 8x (0.81 s) and sends it back
    for _ in range(30):
        model.observe_first_token(again, 20 * again.raw_s)
    assert model.calibration.factor("decode-0", "local") == pytest.approx(8.0, rel=0.01)
    assert model.choose(local, [remote]).placement == "remote"
    assert set(model.calibration.factors()) == {"decode-0/local", "prefill-0/remote"}


def test_small_or_unknown_estimates_teach_nothing():
    model = PlacementModel(SLO)
    tiny = model.choose(Side("decode-0", _load(1e-6), 0, 100, decoding=False), [])  # 0.1 ms raw
    model.observe_first_token(tiny, 0.05)  # a fixed overhead of 50 ms is no 500x slowness
    unknown = model.choose(Side("decode-0", None, 0, 100, decoding=False), [])
    assert math.isinf(unknown.raw_s)
    model.observe_first_token(unknown, 0.3)
    assert model.calibration.factors() == {} and model.calibration.factor("decode-0", "local") == 1.0


def test_a_host_tier_s_blocks_count_for_their_worker_below_a_device_run():
    router = Router(block_size=4)
    tokens = list(range(20))
    hashes = prefix_block_hashes(tokens, 4)  # 5 blocks
    router.remember(tokens[:8], "prefill-0")  # its device: blocks 0-1
    router.host_report("prefill-0", hashes[2:4], [])  # its host tier: blocks 2-3 (evicted from its device)
    router.host_report("prefill-1", hashes[:5], [])  # another worker's host tier: all 5
    assert router.tier_tokens(tokens, "prefill-0") == (8, 8)
    assert router.tier_tokens(tokens, "prefill-1") == (0, 20)
    assert router.effective_cached_tokens(tokens, "prefill-0") == 8 + int(8 * HOST_HIT_VALUE)
    # the prefill pick: 2 device + 2 host blocks (3.5) against 5 host blocks (3.75) with HOST_HIT_VALUE 0.75
    workers = [_worker("prefill-0"), _worker("prefill-1")]
    assert router.pick_prefill(tokens, workers, lambda w: 0).name == "prefill-1"
    assert router.tier_tokens(tokens, "prefill-1") == (20, 0)  # routed there: its device will hold them
    again = Router(block_size=4)
    again.remember(tokens[:8], "prefill-0")
    again.host_report("prefill-0", hashes[2:4], [])
    again.host_report("prefill-1", hashes[:5], [])
    again.host_report("prefill-1", [], hashes[3:5])  # evicted: it holds blocks 0-2 now (2.25 < 3.5)
    assert again.pick_prefill(tokens, workers, lambda w: 0).name == "prefill-0"
    assert again.host_blocks() == {"prefill-0": 2, "prefill-1": 3}
    again.forget_host("prefill-0")  # it died: its host tier went with it
    assert again.host_blocks() == {"prefill-1": 3} and again.tier_tokens(tokens, "prefill-0")[1] == 0
    # a device block is worth more than a host block: at equal lengths the device owner wins
    other = Router(block_size=4)
    other.remember(tokens, "prefill-0")
    other.host_report("prefill-1", hashes, [])
    assert other.pick_prefill(tokens, workers, lambda w: 0).name == "prefill-0"


def _worker(name: str) -> WorkerState:
    info = WorkerInfo(name, "prefill", 100, 4, 1024, 2000, None)
    return WorkerState(info, handle=None)


def test_the_prefill_pick_follows_a_prefill_worker_holding_the_prompt_when_a_decode_worker_holds_more():
    """The device index's latest owner of the longest run is the decode worker that decoded the last turn (prompt
    and reply): no prefill candidate. The pick still goes to the prefill worker holding the prompt (Router._holder:
    the best candidate), not to the least loaded."""
    router = Router(16)
    p0, p1 = (WorkerState(WorkerInfo(f"prefill-{i}", "prefill", 100, 16, 4096, 1000, None), handle=None)
              for i in range(2))
    prompt, reply = list(range(1, 65)), list(range(100, 140))
    router.remember(prompt, "prefill-0")
    router.remember(prompt + reply, "decode-0")
    pressures = {"prefill-0": 10, "prefill-1": 0}
    assert router.pick_prefill(prompt + reply + [7], [p0, p1], lambda w: pressures[w.name]) is p0


def test_a_worker_keeps_the_newest_load_it_reported_whatever_order_they_arrive_in():
    """A decode() reply carries the load of the request's join; the stream may have brought the loads of the steps
    after it first. The older one must not replace them (the coordinator's bookings and /metrics read it)."""
    worker = _workers("decode")[0]
    newer = replace(_load(30e-6), steps=12, taken_at_s=105.0)
    older = replace(_load(30e-6), steps=3, taken_at_s=100.0)
    worker.report(newer)
    worker.report(older)
    assert worker.load.steps == 12
    worker.report(replace(newer, steps=13, taken_at_s=106.0))
    assert worker.load.steps == 13
