"""LoopLag: the coordinator's event-loop lag estimate and its busy flag (hysteresis), driven by lateness figures
and by a real loop that a callback blocks (the flag must turn on; no duration is asserted)."""

import asyncio
import time

import pytest

from coordinator.loop_lag import LoopLag


def test_busy_turns_on_above_the_limit_and_off_below_half_of_it():
    idle_calls = []
    lag = LoopLag(limit_s=0.002, on_idle=lambda: idle_calls.append(1))
    lag.observe(0.010)
    assert not lag.busy                 # one late tick is a slow callback, not a saturated loop
    while not lag.busy:
        lag.observe(0.010)
    lag.observe(0.0015, elapsed_s=0.005)
    assert lag.busy and lag.mean_s < 0.01  # under the limit but above half of it: still busy
    while lag.busy:
        lag.observe(0.0, elapsed_s=0.005)
    assert lag.mean_s < 0.001 and idle_calls == [1] and lag.busy_s > 0
    assert lag.stats()["loop_busy"] == 0.0


def test_measure_only_without_a_limit():
    lag = LoopLag(limit_s=None)
    for _ in range(100):
        lag.observe(1.0)
    assert not lag.busy and lag.mean_s > 0.5


def test_a_blocked_event_loop_is_seen_as_busy():
    async def run():
        lag = LoopLag(limit_s=0.002)
        lag.start()
        try:
            for _ in range(60):             # a callback hogs the loop 20 ms out of every ~20 ms
                time.sleep(0.02)
                await asyncio.sleep(0)
                if lag.busy:
                    return True
            return False
        finally:
            lag.stop()
    assert asyncio.run(run())


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit_s"):
        LoopLag(limit_s=0)
