"""HttpLoopCollector: each HTTP process's event-loop lag (coordinator.observability.loop_lag) as /metrics families,
one series per
process (label `http_process`), so a scrape answered by any process shows every process's own loop. The core's loop
is `pdserve_coordinator_loop_*` (backend stats); these are the HTTP side's."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from coordinator.observability.loop_lag import LoopLag

HELP = {"loop_lag_seconds": "How late this HTTP process's event loop runs (weighted mean lateness of a 5 ms timer)",
        "loop_stalls_total": "Ticks of that timer at least 10 ms late: stalls of every request on the process",
        "loop_lag_max_seconds": "The worst lateness of that timer's ticks since the process started, seconds"}


class HttpLoopCollector:
    def __init__(self, lag: LoopLag, index: int) -> None:
        self.lag, self.index = lag, str(index)

    def collect(self) -> Iterator[Metric]:
        for key, value in self.lag.stats().items():
            kind = CounterMetricFamily if key.endswith("_total") else GaugeMetricFamily
            family = kind(f"pdserve_http_{key}", HELP[key], labels=["http_process"])
            family.add_metric([self.index], float(value))
            yield family
