"""What the coordinator shows about itself and its requests: Prometheus metrics (metrics, metrics_backend), each
request's phases (phases), how late the event loop runs (loop_lag) and what it ran when it stalled (stall_reporter).

May import: config."""
