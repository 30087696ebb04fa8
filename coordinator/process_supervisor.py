"""`pdserve serve`'s process supervisor: it runs the coordinator as a child process and starts it again when it
crashes; the workers outlive it (coordinator.backend.fleet) and the new coordinator adopts them
(coordinator.backend.adoption).

Why a process supervisor and not Ray's restart of a detached coordinator actor: what must survive a coordinator's
crash is not only the workers but the listening socket (bound here once: connections that arrive during a restart
wait in its backlog and are served by the next coordinator, on the same port), the local Ray cluster (started here,
so the workers are not the coordinator's children and no reaper of its takes them along) and the namespace (derived
once, from the port bound). A coordinator inside Ray would need all three passed around and Ray's own restart
machinery to behave under a SIGKILL of its owner; a parent process that waits on a child is a few dozen lines.

Life: bind -> start Ray (a local one on the loopback only: coordinator.backend.ray_network) or join it, in namespace
`namespace` (or pdserve-HOST-PORT) -> the child (`python -m coordinator.cli _coordinator`, its own session) gets the
socket, a pipe on which it says when it serves, and the server's state folder (private, removed at exit): the
configuration loaded at start (frozen: a YAML file edited since is not read again, so an invalid edit cannot stop a
restarted coordinator) and what the coordinators keep across restarts (the tenants' usage,
coordinator.admission.tenant_usage_log). A child that exits after our SIGTERM, or with status 0, ended on purpose.
Any other exit of a coordinator is a crash: it is started again after recovery.backoff_initial_s, doubling per
restart within recovery.restart_window_s up to backoff_max_s, at most recovery.coordinator_max_restarts times in
that window; a server whose first coordinator never served (a start error: no model, pools that cannot be placed) is
not restarted. SIGTERM/SIGINT: forwarded to the child as SIGTERM (it drains and stops its workers; a second signal
skips the wait), then whatever is left in the namespace is torn down and Ray shut down. A pid file
(`pid_file(namespace)`), locked as long as this process lives, lets `pdserve stop` find this process and only it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from coordinator.backend.launch_clock import mark_launch, since_launch
from coordinator.backend.ray_network import confine_local_ray
from coordinator.config.serve_config import ServeConfig

log = logging.getLogger("pdserve")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_CONFIG = "config.pickle"  # in the server's state folder: the frozen configuration of every coordinator


def absolute_path(path: str | None) -> str | None:
    """`path` with `~` expanded, made absolute from this process's directory (`..` resolved, links kept)."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def pid_file(namespace: str) -> Path:
    """Where the supervisor of `namespace`'s server keeps its pid while it runs (and an exclusive lock on the file:
    `supervisor_pid`)."""
    return Path(tempfile.gettempdir()) / "pdserve" / f"{namespace}.pid"


def hold_pid_file(path: Path) -> Any:
    """Write this process's pid into `path` under an exclusive flock(2), held as long as the returned file stays
    open: the kernel drops it when this process ends however it ends, so a file left by a SIGKILLed supervisor is
    known to be stale. RuntimeError if another live process holds it (a server of the same namespace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115 - held open for the server's life (non-inheritable: no child keeps the lock)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"another pdserve serve holds {path}: a server of this namespace is running") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def supervisor_pid(path: Path) -> int | None:
    """The pid in `path` if a live supervisor holds the file's lock; None if there is no file or it is stale (no
    process holds it: its supervisor was killed; the pid in it may be anyone's by now)."""
    try:
        f = open(path)  # noqa: SIM115
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: the supervisor is alive (it wrote the pid before anyone could read it)
            text = f.read().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


class ProcessSupervisor:
    def __init__(self, config: ServeConfig, listener: Any) -> None:
        self.config = config  # as loaded at start: every coordinator gets this one, never the file as it is now
        self._listener = listener  # bound by the caller (a port in use is its error to print)
        self.port = listener.getsockname()[1]
        if config.ray_address is None:  # one machine: Ray, the coordinator and the KV transfers on the loopback only
            confine_local_ray(os.environ)  # before anything here imports Ray
        from coordinator.backend.fleet import default_namespace
        self.namespace = config.namespace or default_namespace(self.port)
        self._stopping = threading.Event()
        self._child: subprocess.Popen | None = None
        self._recent: deque[float] = deque()
        self.restarts = 0

    def run(self) -> int:
        """Serve until stopped on purpose (0) or until the coordinator cannot be kept up (its exit status)."""
        mark_launch()
        from coordinator.backend.ray_start import init_ray
        path = pid_file(self.namespace)
        try:
            held = hold_pid_file(path)
        except RuntimeError as e:
            log.error("pdserve: error: %s", e)
            return 3
        try:
            local = self.config.ray_address is None
            first = self._first_processes() if local else 0
            if init_ray(self.config.ray_address, self.namespace, transfers=self.config.transfers, prestart=first):
                log.warning("pdserve: %d worker process(es) asked for at the raylet's registration", first)
            elif first:
                self._prestart_first_workers(first)
            log.warning("pdserve: Ray %s, %s", "started" if local else "joined", since_launch())
            for sig in (signal.SIGTERM, signal.SIGINT):  # after Ray's: a driver's SIGTERM handler exits at once
                signal.signal(sig, self._on_signal)
            import ray
            address = ray.get_runtime_context().gcs_address
            state = tempfile.TemporaryDirectory(prefix="pdserve-state-")  # private (0700): ours and our children's
            try:
                self._write_child_config(Path(state.name), address)
                return self._loop(Path(state.name), local)
            finally:
                self._teardown()
                ray.shutdown()
                state.cleanup()
        finally:
            path.unlink(missing_ok=True)  # ours while we hold its lock
            held.close()

    def _first_processes(self) -> int:
        """The Ray started here hosts every worker: one process per first worker is started ahead, importing
        pdserve's worker modules (pool_worker.preload) while the coordinator starts; none with
        recovery.warm_processes 0."""
        if self.config.recovery.warm_processes == 0:
            return 0
        return sum(getattr(self.config, pool).workers for pool in self.config.pool_names)

    def _prestart_first_workers(self, count: int) -> None:
        """What init_ray could not ask for at the raylet's registration, now (coordinator.backend.warm_processes)."""
        import ray

        from coordinator.backend.warm_processes import WarmProcesses
        WarmProcesses(count, any_job=True).prestart(ray.get_runtime_context().get_node_id(), count)

    def _write_child_config(self, state: Path, address: str) -> None:
        """The configuration every coordinator of this server runs with (coordinator.cli's `_coordinator` reads it):
        the one loaded at start, with the port bound, the namespace and the Ray address filled in, and its paths
        (model, server.traces_file) made absolute: relative ones are taken from this process's directory, where
        `pdserve serve` was run, while the coordinator runs in the project's (ROOT: Ray puts its driver's directory
        on its workers' module path). Frozen here, so an edit of the YAML file reaches no coordinator restarted after
        a crash; a changed file is applied by restarting the whole server (`pdserve stop`, then `pdserve serve`)."""
        server = dataclasses.replace(self.config.server, port=self.port,
                                     traces_file=absolute_path(self.config.server.traces_file))
        model = self.config.model if self.config.model == "tiny" else absolute_path(self.config.model)
        config = dataclasses.replace(self.config, server=server, namespace=self.namespace, ray_address=address,
                                     model=model)
        (state / CHILD_CONFIG).write_bytes(pickle.dumps(config))

    def _loop(self, state: Path, local: bool) -> int:
        served_once = False
        while True:
            started = time.monotonic()
            rc, served = self._run_child(state, local)
            served_once = served_once or served
            if self._stopping.is_set() or rc == 0:
                return 0
            if not served_once:
                log.error("pdserve: the coordinator exited with status %s before it served; stopping", rc)
                return rc if rc > 0 else 1
            now = time.monotonic()
            while self._recent and now - self._recent[0] > self.config.recovery.restart_window_s:
                self._recent.popleft()
            limit = self.config.recovery.coordinator_max_restarts
            if len(self._recent) >= limit:
                log.error("pdserve: the coordinator exited with status %s; %d restarts within %g s "
                          "(recovery.coordinator_max_restarts %d): stopping", rc, len(self._recent),
                          self.config.recovery.restart_window_s, limit)
                return rc if rc > 0 else 1
            delay = min(self.config.recovery.backoff_max_s,
                        self.config.recovery.backoff_initial_s * 2 ** len(self._recent))
            self._recent.append(now)
            log.warning("pdserve: the coordinator (pid %d) exited with status %s after %.1f s; starting it again "
                        "in %.1f s (it adopts the running workers)", self._child.pid, rc, now - started, delay)
            if self._stopping.wait(delay):
                return 0
            self.restarts += 1

    def _run_child(self, state: Path, local: bool) -> tuple[int, bool]:
        """Run one coordinator until it exits: (its exit status, whether it served)."""
        ready_r, ready_w = os.pipe()
        fd = self._listener.fileno()
        command = [sys.executable, "-m", "coordinator.cli", "_coordinator", str(state), str(fd), str(ready_w),
                   "local" if local else "joined"]
        self._child = subprocess.Popen(command, pass_fds=(fd, ready_w), start_new_session=True, cwd=ROOT)
        os.close(ready_w)
        if self._stopping.is_set():  # a signal that came while it was being started
            self._child.send_signal(signal.SIGTERM)
        served = False
        try:
            while True:
                if select.select([ready_r], [], [], 0.5)[0]:
                    if not os.read(ready_r, 1):  # the pipe closed: the child is ending
                        return self._child.wait(), served
                    served = True
                    log.warning("pdserve: coordinator pid %d serving (namespace %s)", self._child.pid,
                                self.namespace)
                rc = self._child.poll()
                if rc is not None:
                    return rc, served
        finally:
            os.close(ready_r)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stopping.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # the child drains; a second signal skips its wait

    def _teardown(self) -> None:
        """Nothing of this server stays in the namespace (the child stopped its workers; this is for a child that
        could not: killed, crashed past its restarts, or stopped before it served)."""
        from coordinator.backend.fleet import teardown
        try:
            asyncio.run(teardown("the server is stopping"))
        except Exception as e:  # noqa: BLE001 - the local Ray's shutdown still follows; a joined one says why
            log.error("pdserve: tearing down namespace %s failed: %s: %s", self.namespace, type(e).__name__, e)
