"""Coordinator: the process that serves the OpenAI-compatible API and runs every request across the worker pools.
It never touches tensors. A request passes its packages as stages, each visited once:

    api/           the HTTP edge: OpenAI body -> one GenerateRequest (protocol), the request's life (lifecycle),
                   internal outputs -> SSE / JSON (sse, choices, tool_stream), model routes, admin routes
    admission/     who may run and when: tenants' keys and limits, the waiting queue, the booking ledger, and
                   Admission, which places a request on workers and books its KV there
    backend/       the Ray pools that run it: workers' states, router, supervisor (replaces dead workers),
                   RayBackend (one request's attempts across workers), groups, drills
    observability/ metrics, per-request phases, loop lag, stall reports
    config/        the serving YAML, validated once and frozen
    frontends/     HTTP in several processes in front of one core process

and at the top `cli` (the `pdserve` command) and `serve` (start the pools, serve HTTP, drain). Two modules are
shared vocabulary: `contract` (ServingBackend, GenerateRequest, TokenDelta and the backend's errors) and `errors`
(OpenAI-shaped HTTP errors), with `client_text` under it (what of a failure's or the input's text an error may
repeat). `process_supervisor` serves `pdserve serve` at the top (its local Ray on the loopback: `backend.ray_network`).

Imports point down this list only (tests/test_import_structure.py keeps it so):
cli, serve -> frontends -> api -> backend -> admission -> contract, errors -> client_text, observability -> config.
"""
