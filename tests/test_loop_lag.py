"""LoopLag: the coordinator's event-loop lag estimate, driven by lateness figures and by a real loop that a callback
blocks (the estimate must rise well above an idle loop's; no duration is asserted)."""

import asyncio
import time

from coordinator.observability.loop_lag import LoopLag


def test_the_mean_follows_the_ticks_lateness():
    lag = LoopLag()
    lag.observe(0.010)
    assert 0 < lag.mean_s < 0.010      # one late tick moves it a step, not all the way
    for _ in range(200):
        lag.observe(0.010)
    assert abs(lag.mean_s - 0.010) < 1e-4
    for _ in range(200):
        lag.observe(0.0)
    assert lag.mean_s < 1e-4
    assert lag.stats() == {"loop_lag_seconds": lag.mean_s, "loop_stalls_total": 201, "loop_lag_max_seconds": 0.010}


def test_a_blocked_event_loop_shows_lag():
    async def run():
        lag = LoopLag()
        lag.start()
        try:
            for _ in range(30):             # a callback hogs the loop 20 ms at a time
                time.sleep(0.02)
                await asyncio.sleep(0)
            return lag
        finally:
            lag.stop()
    lag = asyncio.run(run())
    assert lag.mean_s > 0.002 and lag.stalls >= 10 and lag.max_s >= 0.01
