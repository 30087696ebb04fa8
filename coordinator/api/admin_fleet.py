"""Operators' fleet endpoints (with coordinator.api.admin's: only with `server.admin_api` and the operator's key).

- POST /admin/workers/{name}/revive: start a worker slot again whose restarts gave up (past recovery.max_restarts,
  state "failed"): {"worker", "revived": true}; a 409 when the slot has not given up, a 404 for no such slot.
- POST /admin/workers/restart: a rolling restart (coordinator.backend.cycling): every worker drained, emptied,
  replaced and routed to again, one at a time. Body (all optional): {"allow_pause": bool, "drain_timeout_s":
  number in (0, 3600]}. 202 with the order; a 409 when a worker is the only one of its pool (unless allow_pause)
  or a rolling restart is running. GET /admin/workers/restart: its progress.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from coordinator import errors

DRAIN_TIMEOUT_S = 300.0  # default wait for a drained worker's requests before they are moved
MAX_DRAIN_TIMEOUT_S = 3600.0
RESTART_FIELDS = ("allow_pause", "drain_timeout_s")


def install_fleet_routes(app: FastAPI, check_auth: Callable[[Request], None]) -> None:
    backend = app.state.backend

    @app.post("/admin/workers/{name}/revive")
    async def revive_worker(name: str, request: Request) -> JSONResponse:
        """Start slot `name` again after its restarts gave up."""
        check_auth(request)
        revived = await backend.revive_worker(name)
        if revived is None:
            raise errors.APIError(404, "no worker of that name", "invalid_request_error", "not_found", "name")
        if not revived:
            raise errors.APIError(409, f"{name} has not given up restarting (it is live or being replaced): nothing "
                                  "to revive", "invalid_request_error", "conflict", "name", code="not_failed")
        return JSONResponse({"worker": name, "revived": True})

    @app.post("/admin/workers/restart")
    async def restart_workers(request: Request) -> JSONResponse:
        """Begin a rolling restart of every worker."""
        check_auth(request)
        allow_pause, drain_timeout_s = await _restart_body(request)
        try:
            order = await backend.restart_workers(drain_timeout_s, allow_pause)
        except ValueError as e:  # coordinator.backend.cycling.CycleRefused
            raise errors.APIError(409, str(e), "invalid_request_error", "conflict", None,
                                  code="restart_refused") from None
        return JSONResponse({"restart": "running", "order": order}, status_code=202)

    @app.get("/admin/workers/restart")
    async def restart_status(request: Request) -> JSONResponse:
        """The rolling restart's progress: state, current worker, steps done (old and new pids), error."""
        check_auth(request)
        return JSONResponse(await backend.restart_status())


async def _restart_body(request: Request) -> tuple[bool, float]:
    """(allow_pause, drain_timeout_s) from an optional JSON object; a 400 naming the field otherwise."""
    raw = await request.body()
    if not raw.strip():
        return False, DRAIN_TIMEOUT_S
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise errors.invalid_request("the body must be a JSON object: {\"allow_pause\": bool, \"drain_timeout_s\": "
                                     "seconds}")
    unknown = sorted(set(body) - set(RESTART_FIELDS))
    if unknown:
        raise errors.invalid_request(f"unknown field {unknown[0]!r}; known: {list(RESTART_FIELDS)}", unknown[0])
    allow_pause = body.get("allow_pause", False)
    if not isinstance(allow_pause, bool):
        raise errors.invalid_request(f"allow_pause must be true or false, got {allow_pause!r}", "allow_pause")
    timeout = body.get("drain_timeout_s", DRAIN_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) \
            or not 0 < timeout <= MAX_DRAIN_TIMEOUT_S:
        raise errors.invalid_request(f"drain_timeout_s must be a number in (0, {MAX_DRAIN_TIMEOUT_S:g}], got "
                                     f"{timeout!r}", "drain_timeout_s")
    return allow_pause, float(timeout)
