"""The Ray backend: the worker pools (pools: create, connect, replace, stop), what the coordinator knows of each
worker (router: WorkerState, Router), the supervisor that notices dead workers and replaces them (supervisor),
one request's attempts across workers with migration (ray_backend; one attempt: attempts), n-choice groups
(ray_group), operators' drills (drills), workers an operator took out of routing (drains), what workers hold
against the bookings for /admin/integrity (block_audit) and the figures /metrics reads (stats).

May import: admission, contract, errors, observability, config, and the worker packages (prefill_pool,
decode_pool) whose actor classes it starts."""
