"""Warm processes: Ray worker processes started ahead on the nodes that host pdserve's workers, so that a worker
started later (a replacement, a scale-out, a spare, a role's restart) skips the process start and, where the raylet
preloads pool_worker.preload (or pool_worker.preload_engine, collocated), the imports (torch, the engine, the
transfer agents): seconds of every such start.

Ray hands an actor an idle worker process of the same job and runtime environment when it has one, and otherwise
starts a new one; it never starts one ahead by itself after its first driver (which pdserve turns off: it would
start one per CPU). So this asks each node's raylet to start `count` processes for the coordinator's job
(NodeManagerService.PrestartWorkers, the RPC Ray's own worker pool uses), once when the pools are up, and one more
each time a worker was started on that node (replacing the process it took); `pdserve serve`'s supervisor asks for
the first workers' processes as soon as it has started Ray, so they import while the coordinator starts. A worker
that found none ready starts as before. The processes end with the coordinator's job (the supervisor's, with the Ray
it started). Needs grpcio and Ray 2.60's internal RPC modules, and a job without a runtime_env (a job-level
runtime_env makes Ray refuse processes started without it); where any of that is missing, `available` is False and
the reason is logged once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

log = logging.getLogger(__name__)
KEEP_ALIVE_S = 7 * 24 * 3600  # Ray does not reap them as idle meanwhile; they end with the job anyway
RPC_TIMEOUT_S = 10.0
NIL_JOB = b"\xff" * 4  # Ray's nil JobID: a process of no job yet, which any job's actor may take


class WarmProcesses:
    """Keeps `count` idle worker processes per node of the coordinator's job. Owned by coordinator.backend.pools:
    `top_up(node, n)` after the pools started (n = count) and after each worker started (n = 1)."""

    def __init__(self, count: int, any_job: bool = False) -> None:
        """`any_job`: processes for whichever job asks first (`pdserve serve`'s supervisor starts the first workers'
        processes this way, before its coordinator, a job of its own, exists)."""
        self.count = count
        self._any_job = any_job
        self.requested: dict[str, int] = {}  # node id -> processes asked for (what was sent)
        self._stubs: dict[str, Any] = {}
        self._job: bytes | None = None
        self.unavailable = "" if count > 0 else "recovery.warm_processes is 0"

    @property
    def available(self) -> bool:
        return not self.unavailable

    def _setup(self) -> None:
        if self._job is not None or not self.available:
            return
        context = ray.get_runtime_context()
        if context.runtime_env:
            self._disable(f"the job has a runtime_env ({sorted(context.runtime_env)}): Ray gives an actor only a "
                          "process started with the same one")
            return
        try:
            import grpc  # noqa: F401 - Ray's generated stubs need it
            from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc  # noqa: F401
        except ImportError as e:
            self._disable(f"cannot reach the raylets' RPC: {e}")
            return
        self._job = NIL_JOB if self._any_job else bytes.fromhex(context.get_job_id())

    def _disable(self, reason: str) -> None:
        self.unavailable = reason
        log.warning("no warm worker processes: %s; every worker start spawns its own process", reason)

    def _stub(self, node_id: str) -> Any:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2_grpc

        if node_id not in self._stubs:
            node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
            if node is None:
                raise LookupError(f"node {node_id} is not alive")
            address = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
            self._stubs[node_id] = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))
        return self._stubs[node_id]

    def prestart(self, node_id: str | None, n: int = 1) -> None:
        """Ask `node_id`'s raylet to start `n` more processes ahead (a blocking RPC of milliseconds). Never raises:
        a failure is logged (the worker starts that follow spawn their own processes, as without this)."""
        if not self.available or node_id is None or n < 1:
            return
        from ray.core.generated import common_pb2, node_manager_pb2

        try:
            self._setup()
            if not self.available:
                return
            request = node_manager_pb2.PrestartWorkersRequest(language=common_pb2.PYTHON, job_id=self._job,
                                                              keep_alive_duration_secs=KEEP_ALIVE_S, num_workers=n)
            self._stub(node_id).PrestartWorkers(request, timeout=RPC_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - an optimization: never the reason a start fails
            self._stubs.pop(node_id, None)
            log.warning("could not start %d worker process(es) ahead on node %s: %s: %s", n, node_id,
                        type(e).__name__, e)
            return
        self.requested[node_id] = self.requested.get(node_id, 0) + n

    async def top_up(self, node_id: str | None, n: int = 1) -> None:
        """prestart() off the event loop."""
        await asyncio.to_thread(self.prestart, node_id, n)


def bundle_node(group: Any, bundle: int) -> str | None:
    """The id of the node that holds placement group `group`'s bundle `bundle` (None while unplaced or unknown)."""
    try:
        table = ray.util.placement_group_table(group)
    except Exception:  # noqa: BLE001 - a group removed meanwhile
        return None
    return (table.get("bundles_to_node_id") or {}).get(bundle) or None
