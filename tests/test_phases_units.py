"""Phase arithmetic, without a server: PhaseTrace partitions [arrival, now] whatever the worker-measured durations
say (clamped into their interval, the rest named overhead; migrations add up), the wire form, the workers'
RequestTiming on a fake clock, and the scheduler's first-step stamp it reads."""

import math

import pytest

from coordinator.observability.phases import PHASES, PhaseTrace, wire
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.request_timing import RequestTiming
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler


def total(phases: dict[str, float]) -> float:
    return math.fsum(phases.values())


def test_marks_and_splits_partition_the_time_since_arrival():
    t = PhaseTrace(10.0)
    t.mark("ingress", 10.5)
    t.mark("admission", 12.0)
    t.split([("prefill_queue", 0.25), ("prefill_compute", 1.0)], 14.0)  # 2 s interval: 0.75 s is overhead
    t.split([("kv_transfer", 0.5), ("decode_join", 0.125), ("first_decode_step", 0.25)], 15.0)
    t.mark("decode", 18.0)
    t.mark("decode", 19.0)
    got = t.finish(20.0)
    assert got == {"ingress": 0.5, "admission": 1.5, "prefill_queue": 0.25, "prefill_compute": 1.0,
                   "overhead": 0.75 + 0.125 + 1.0, "kv_transfer": 0.5, "decode_join": 0.125,
                   "first_decode_step": 0.25, "decode": 4.0}
    assert total(got) == pytest.approx(10.0, abs=1e-12)


def test_worker_durations_are_clamped_into_their_interval_in_order():
    t = PhaseTrace(0.0)
    t.split([("kv_transfer", 3.0), ("decode_join", 5.0), ("first_decode_step", 1.0)], 4.0)  # a slow remote clock
    assert t.snapshot(4.0) == {"kv_transfer": 3.0, "decode_join": 1.0, "first_decode_step": 0.0, "overhead": 0.0}
    t = PhaseTrace(0.0)
    t.split([("prefill_queue", -2.0), ("prefill_compute", float("nan")), ("decode_join", float("inf"))], 1.0)
    assert t.snapshot(1.0) == {"prefill_queue": 0.0, "prefill_compute": 0.0, "decode_join": 1.0, "overhead": 0.0}
    t = PhaseTrace(0.0)
    t.split([], 2.0)  # a worker that sent nothing: the whole interval is overhead
    assert t.snapshot(2.0) == {"overhead": 2.0}


def test_a_migrated_request_adds_its_attempts_and_names_the_lost_interval():
    t = PhaseTrace(0.0)
    t.mark("ingress", 1.0)
    t.mark("admission", 2.0)
    t.split([("prefill_queue", 1.0), ("prefill_compute", 1.0)], 4.0)
    t.mark("decode", 6.0)
    t.mark("migration", 9.0)  # the worker died 3 s after the last token the coordinator got
    t.mark("admission", 10.0)  # the second attempt: placed again, prompt + tokens sent recomputed elsewhere
    t.split([("prefill_queue", 0.5), ("prefill_compute", 2.0)], 13.0)
    t.mark("decode", 15.0)
    got = t.finish(15.0)
    assert got["migration"] == 3.0 and got["admission"] == 2.0 and got["prefill_compute"] == 3.0
    assert got["decode"] == 4.0 and got["prefill_queue"] == 1.5 and got["overhead"] == 0.5
    assert total(got) == 15.0


def test_snapshot_does_not_change_the_trace_and_finish_is_final():
    t = PhaseTrace(0.0)
    t.mark("ingress", 1.0)
    assert t.snapshot(3.0) == {"ingress": 1.0, "overhead": 2.0}
    assert t.snapshot(4.0) == {"ingress": 1.0, "overhead": 3.0}
    final = t.finish(5.0)
    t.mark("decode", 7.0)
    assert t.finish(9.0) == final == t.snapshot(10.0) == {"ingress": 1.0, "overhead": 4.0}


def test_time_never_runs_backwards_and_the_clock_default_is_monotonic():
    t = PhaseTrace(5.0)
    t.mark("ingress", 4.0)  # an earlier stamp than the cursor counts as no time
    assert t.snapshot(5.0) == {"ingress": 0.0, "overhead": 0.0}
    live = PhaseTrace.now()
    live.mark("ingress")
    assert all(v >= 0 for v in live.snapshot().values())


def test_wire_rounds_to_microseconds_in_phase_order():
    got = wire({"overhead": 0.1234567, "decode": 2.0, "ingress": 1e-7})
    assert list(got) == [p for p in PHASES if p in got] == ["ingress", "decode", "overhead"]
    assert got == {"ingress": 0.0, "decode": 2.0, "overhead": 0.123457}


def _request(rid: str, n: int = 6) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True), (0,), 1024)


def test_the_scheduler_stamps_a_requests_first_step_only():
    now = [1.0]
    s = Scheduler(BlockManager(32, 4, True), 8, 4, clock=lambda: now[0])  # budget 4: a 6-token prompt takes 2 steps
    a = _request("a")
    s.add(a)
    assert a.first_scheduled_at is None
    now[0] = 2.0
    out = s.schedule()
    s.update(out, {}, 60.0)
    now[0] = 3.0
    out = s.schedule()
    s.update(out, {c.request_id: (7, None) for c in out.chunks if c.sample}, 60.0)
    assert a.first_scheduled_at == 2.0 and a.num_output_tokens == 1


def test_request_timing_of_a_computed_and_of_a_pulled_request():
    now = [0.0]
    timing = RequestTiming(clock=lambda: now[0])
    computed, pulled = _request("c"), _request("p")
    timing.received("c")
    timing.attach("c", computed)
    computed.first_scheduled_at = 0.5
    now[0] = 2.0
    assert timing.first_output("c") == (("prefill_queue", 0.5), ("prefill_compute", 1.5))
    assert timing.first_output("c") is None  # once: later outputs carry nothing
    timing.received("p")
    now[0] = 3.0
    timing.kv_ready("p")
    timing.attach("p", pulled)
    pulled.first_scheduled_at = 3.25
    now[0] = 4.0
    assert timing.first_output("p") == (("kv_transfer", 1.0), ("decode_join", 0.25), ("first_decode_step", 0.75))
    timing.received("ended")  # its first token was its last: it never ran a decode step here
    timing.kv_ready("ended")
    timing.attach("ended", None)
    now[0] = 4.5
    assert timing.first_output("ended") == (("kv_transfer", 0.0), ("decode_join", 0.5))
    timing.received("gone")
    timing.drop("gone")  # aborted: nothing kept, nothing reported
    assert timing.first_output("gone") is None and len(timing) == 0
    assert timing.first_output("never-timed") is None


def test_request_timing_of_a_request_that_joined_before_its_kv_landed():
    """decode_pool starts a request whose KV copies are still landing (the device orders them before its first
    step): the stamp moves from the launch to the landing, and the phases still add up to the total."""
    now = [0.0]
    timing = RequestTiming(clock=lambda: now[0])
    req = _request("early")
    timing.received("early")
    now[0] = 0.5
    timing.kv_ready("early")  # provisional: the copies are queued
    timing.attach("early", req)
    req.first_scheduled_at = 0.75  # its first step is queued behind the copies
    now[0] = 1.25
    timing.kv_ready("early")  # the copies were seen to end
    now[0] = 3.0
    phases = timing.first_output("early")
    assert phases == (("kv_transfer", 1.25), ("decode_join", 0.0), ("first_decode_step", 1.75))
    assert math.fsum(d for _, d in phases) == 3.0
