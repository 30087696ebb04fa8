"""StallReporter: a loop held by one callback is reported once, with the stack of what holds it."""

import asyncio
import logging
import time

from coordinator.observability.stall_reporter import StallReporter


def _busy_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # pure Python: the GIL changes hands, the loop does not run
        pass


def test_a_stalled_loop_is_reported_with_the_stack_that_holds_it(caplog):
    async def run() -> StallReporter:
        reporter = StallReporter(0.02, "test loop")
        reporter.start()
        await asyncio.sleep(0.05)
        _busy_for(0.4)
        await asyncio.sleep(0.05)
        reporter.stop()
        return reporter
    with caplog.at_level(logging.WARNING, logger="pdserve.stalls"):
        reporter = asyncio.run(run())
    assert reporter.reports >= 1
    report = next(r.getMessage() for r in caplog.records if "_busy_for" in r.getMessage())
    assert report.startswith("test loop: event loop stalled for") and "it is running:" in report and "in run" in report
    assert "other threads, innermost frame:" in report
