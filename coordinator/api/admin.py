"""Operators' endpoints, off unless `server.admin_api` is true, and then only for the operator's own key
(`server.admin_api_key`; a tenant's key or server.api_key is a client's, and gets a 401).

- POST /admin/workers/{name}/kill: kill a live worker's process (drills: the pool replaces it, its requests move).
- POST /admin/workers/{name}/drain: route no new work to the worker; what runs there finishes, then /health says
  it is drained ({"worker", "drain": "draining" | "drained"}; coordinator.backend.drains). A 409 when it is the last
  live worker that can decode or prefill. POST /admin/workers/{name}/undrain: route to it again.
- POST /admin/workers/{name}/role: mode adaptive, give a worker a role ({"role": "prefill" | "decode" | "mixed"}).
- POST /admin/faults: set the injected faults of every worker now and of every replacement later (a JSON body with
  FaultsConfig's fields; `{}` turns them off).
- GET /admin/requests: the ids of the single-choice requests in flight ({"object": "list", "data": [ids]}).
  GET /admin/requests/{id}: one of them as the coordinator sees it (coordinator.backend.inflight: state, placement,
  workers, KV blocks booked and used, phases so far, migrations); a 404 for an id not in flight (finished, unknown,
  or a choice of an n > 1 request). The id is the request's X-Request-Id (the response body's id without its
  `chatcmpl-` / `cmpl-` prefix is accepted too).
- GET /admin/integrity: the coordinator's bookings checked against the requests in flight, every live engine's
  block ownership check, and what each worker holds against what is booked there (`mismatches`:
  coordinator.backend.block_audit); `ok` is false with the reason when any fails.
Also `health_response`: the truthful /health (200 only while every pool has a live worker and the server is not
draining; otherwise 503 with each worker's state); each worker's pid, host and last failure only for the operator, and
so is `scaling` (where pools scale: their sizes, limits and recent scale events).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from coordinator import errors

PUBLIC_WORKER_FIELDS = ("name", "role", "state", "restarts", "drain")  # what /health shows without the operator's key


def health_response(backend: Any, draining: bool, operator: bool = False) -> JSONResponse:
    """ok / draining / unavailable, with the workers (only PUBLIC_WORKER_FIELDS of each unless `operator`); with
    several HTTP processes, also which one answered (`http_process`, its index: coordinator.frontends)."""
    healthy, workers = backend.health() if hasattr(backend, "health") else (True, [])
    if not operator:
        workers = [{k: w[k] for k in PUBLIC_WORKER_FIELDS if k in w} for w in workers]
    process = getattr(backend, "process_index", None)
    extra = {} if process is None else {"http_process": process}
    if operator and hasattr(backend, "health_extra"):  # the pools' scaling (coordinator.backend.scaler)
        extra |= backend.health_extra()
    if draining:
        return JSONResponse({"status": "draining", "workers": workers, **extra}, status_code=503,
                            headers={"Retry-After": "1"})
    if not healthy:
        return JSONResponse({"status": "unavailable", "workers": workers, **extra}, status_code=503,
                            headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok", "workers": workers, **extra})


def install_admin_routes(app: FastAPI, check_auth: Callable[[Request], None]) -> None:
    backend = app.state.backend

    @app.post("/admin/workers/{name}/kill")
    async def kill_worker(name: str, request: Request, rank: int | None = None) -> JSONResponse:
        """Kill worker `name`'s process, or (`?rank=r`) only its tensor-parallel rank r (a lost GPU of a group)."""
        check_auth(request)
        try:
            found = await (backend.kill_worker(name) if rank is None else backend.kill_rank(name, rank))
        except ValueError as e:
            raise errors.APIError(400, str(e), "invalid_request_error", "invalid_value", "rank") from None
        if not found:
            raise errors.APIError(404, f"no live worker named {name!r}", "invalid_request_error", "not_found",
                                  "name")
        return JSONResponse({"killed": name, **({"rank": rank} if rank is not None else {})})

    @app.post("/admin/workers/{name}/drain")
    async def drain_worker(name: str, request: Request) -> JSONResponse:
        """Take worker `name` out of routing: {"worker": name, "drain": "draining" | "drained"}."""
        check_auth(request)
        try:
            state = await backend.drain_worker(name)
        except ValueError as e:  # the last live worker of a pool (coordinator.backend.drains.DrainRefused)
            raise errors.APIError(409, str(e), "invalid_request_error", "conflict", "name",
                                  code="last_live_worker") from None
        if state is None:
            raise errors.APIError(404, "no worker of that name", "invalid_request_error", "not_found", "name")
        return JSONResponse({"worker": name, "drain": state})

    @app.post("/admin/workers/{name}/undrain")
    async def undrain_worker(name: str, request: Request) -> JSONResponse:
        """Route to worker `name` again: {"worker": name, "undrained": whether it was drained or draining}."""
        check_auth(request)
        undrained = await backend.undrain_worker(name)
        if undrained is None:
            raise errors.APIError(404, "no worker of that name", "invalid_request_error", "not_found", "name")
        return JSONResponse({"worker": name, "undrained": undrained})

    @app.post("/admin/workers/{name}/role")
    async def set_role(name: str, request: Request) -> JSONResponse:
        """Mode adaptive: give worker `name` a role, {"role": "prefill" | "decode" | "mixed"} (the planner may move
        it again later); what runs on it goes on."""
        check_auth(request)
        try:
            body = await request.json()
        except ValueError:
            body = None
        role = body.get("role") if isinstance(body, dict) else None
        if not isinstance(role, str) or set(body) != {"role"}:
            raise errors.APIError(400, 'the body must be {"role": "prefill" | "decode" | "mixed"}',
                                  "invalid_request_error", "invalid_value", "role")
        try:
            found = await backend.set_role(name, role)
        except ValueError as e:
            raise errors.APIError(400, str(e), "invalid_request_error", "invalid_value", "role") from None
        if not found:
            raise errors.APIError(404, "no worker of that name", "invalid_request_error", "not_found", "name")
        return JSONResponse({"worker": name, "role": role})

    @app.post("/admin/faults")
    async def set_faults(request: Request) -> JSONResponse:
        check_auth(request)
        from coordinator.config.faults_config import FaultsConfig
        try:
            body = await request.json()
            faults = FaultsConfig(**body) if isinstance(body, dict) else None
        except (ValueError, TypeError) as e:
            raise errors.invalid_request(f"faults: {e}") from None
        if faults is None:
            raise errors.invalid_request("faults: the body must be a JSON object of FaultsConfig fields")
        try:
            await backend.set_faults(faults)
        except ValueError as e:  # a worker name that names none (coordinator.backend.drills)
            raise errors.invalid_request(f"faults: {e}", "slow_workers") from None
        return JSONResponse({"faults": dataclasses.asdict(faults)})

    @app.get("/admin/requests")
    async def requests_in_flight(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse({"object": "list", "data": await _requests(backend).requests_in_flight()})

    @app.get("/admin/requests/{request_id}")
    async def request_in_flight(request_id: str, request: Request) -> JSONResponse:
        check_auth(request)
        inflight = _requests(backend)
        for rid in (request_id, request_id.removeprefix("chatcmpl-"), request_id.removeprefix("cmpl-")):
            view = await inflight.request_view(rid)
            if view is not None:
                return JSONResponse(view)
        raise errors.APIError(404, f"no request {request_id[:64]!r} in flight (finished, unknown, or a choice of an "
                              "n > 1 request)", "invalid_request_error", "not_found", "request_id")

    @app.get("/admin/integrity")
    async def integrity(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse(await backend.integrity())


def _requests(backend: Any) -> Any:
    """The backend's view of its requests in flight (an HTTP frontend process of several asks the core process:
    coordinator.frontends); a 501 from a backend that keeps none."""
    if not hasattr(backend, "request_view"):
        raise errors.APIError(501, "this server's backend keeps no view of its requests in flight",
                              "invalid_request_error", "not_implemented")
    return backend
