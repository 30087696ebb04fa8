"""The first workers' processes, asked of a local Ray's raylet the moment it registers, while `ray.init` still runs.

A `pdserve serve` that starts its own Ray has its first workers wait for their processes' boot and imports
(pool_worker.preload: torch, the engine; ~4-5 s on an H200 host), which can only begin once the raylet runs. `ray.init`
returns 0.2-0.6 s after the raylet registered with the GCS there (it polls for the node once a second, then connects
the driver); this starts the processes at the registration instead. A thread beside `ray.init` finds the session
folder Ray makes for this process (`session_*_<pid>` under Ray's temp folder), the GCS port Ray persists in it,
then polls the GCS every POLL_S for the alive node and sends its raylet PrestartWorkers for no job in particular
(coordinator.backend.warm_processes, `any_job`). Every step is Ray 2.60's own layout and RPCs; where one is missing
or fails, the thread gives up quietly and the caller asks after `ray.init`, as before (`finish`).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time

log = logging.getLogger("pdserve")
POLL_S = 0.05
GIVE_UP_S = 60.0  # ray.init's own raylet wait is 30 s, tried twice


class EarlyPrestart:
    """`start()` before `ray.init`, `finish()` after it: `count` processes are asked for exactly once, by the
    thread if it saw the raylet first, else by finish()'s caller (finish() says which)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._lock = threading.Lock()
        self._sent = False    # the thread asked the raylet
        self._closed = False  # finish() ran: the thread must not ask any more
        self._began = time.time()
        self._thread = threading.Thread(target=self._run, name="early-prestart", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> bool:
        """Stop the thread; True if it asked for the processes (the caller then must not)."""
        with self._lock:
            self._closed = True
            return self._sent

    def _run(self) -> None:
        try:
            address = self._raylet_address()
            if address is None:
                return
            with self._lock:  # held across the RPC (<= RPC_TIMEOUT_S): finish() waits rather than ask twice
                if self._closed:
                    return
                self._sent = prestart_at(address, self.count)
        except Exception as e:  # noqa: BLE001 - an optimization: finish()'s caller asks instead
            log.info("processes not started ahead at the raylet's registration: %s: %s", type(e).__name__, e)

    def _open(self) -> bool:
        with self._lock:
            return not self._closed and time.time() - self._began < GIVE_UP_S

    def _raylet_address(self) -> str | None:
        """host:port of the raylet of the Ray this process is starting, once it registered (None: gave up)."""
        from ray._common.utils import get_default_ray_temp_dir
        from ray._raylet import GcsClient
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        pattern = os.path.join(get_default_ray_temp_dir(), f"session_*_{os.getpid()}", "gcs_server_port_*")
        port = None
        while port is None and self._open():
            port = next((p for p in map(_read_port, self._fresh(glob.glob(pattern))) if p), None)
            if port is None:
                time.sleep(POLL_S)
        if port is None:
            return None
        import ray

        gcs = GcsClient(address=f"{ray.util.get_node_ip_address()}:{port}")
        while self._open():
            nodes = gcs.get_all_node_info(timeout=5, state_filter=GcsNodeInfo.GcsNodeState.ALIVE).values()
            node = next(iter(nodes), None)
            if node is not None:
                return f"{node.node_manager_address}:{node.node_manager_port}"
            time.sleep(POLL_S)
        return None

    def _fresh(self, paths: list[str]) -> list[str]:
        """The port files written since this start began (an earlier try's session folder is not ours now)."""
        return [p for p in paths if _mtime(p) >= self._began - 1.0]


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _read_port(path: str) -> int | None:
    try:
        text = open(path).read().strip()  # noqa: SIM115 - tiny; may be half written
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def prestart_at(address: str, count: int) -> bool:
    """Ask the raylet at `address` for `count` worker processes of no job yet (any job's actor may take them)."""
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    from coordinator.backend.warm_processes import KEEP_ALIVE_S, NIL_JOB, RPC_TIMEOUT_S

    stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))
    stub.PrestartWorkers(node_manager_pb2.PrestartWorkersRequest(
        language=common_pb2.PYTHON, job_id=NIL_JOB, keep_alive_duration_secs=KEEP_ALIVE_S, num_workers=count),
        timeout=RPC_TIMEOUT_S)
    return True
