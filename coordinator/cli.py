"""The `pdserve` command line: `serve` (the disaggregated server), `stop` (stop one on purpose), `generate`
(offline, one engine), `bench` (load-test an OpenAI-compatible endpoint) and `sweep` (pool-sizing experiments; both
in benchclient/). `serve` runs the coordinator under a process supervisor (coordinator.process_supervisor), which
starts it again after a crash as the hidden command `_coordinator` (this module's `coordinator_main`).

Also the server's watchdog: `pdserve serve` starts a tiny process (its own session, so a signal to the server's
process group spares it) that keeps a snapshot of the server's process tree (Ray's GCS, raylet, agents, workers)
and, once the server is gone however it died (SIGKILL included: it sees the end of a pipe only the server holds),
kills whatever of that tree is still alive. Ray's agents do not exit when their raylet is SIGKILLed, and nothing
of a local Ray started by a killed server must stay behind. Processes of a Ray cluster the server only joined
(`--ray-address auto`) are not its descendants and are never touched.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import select
import signal
import subprocess
import sys
import time

COMMANDS = {
    "serve": "serve the OpenAI-compatible API from Ray prefill/decode pools",
    "stop": "stop a running `pdserve serve` on purpose: drain, stop its workers, empty its Ray namespace",
    "generate": "complete prompts offline on one engine",
    "bench": "load-test an OpenAI-compatible endpoint (pdserve, vLLM, ...)",
    "sweep": "pool-sizing sweep: layouts x workloads x loads, each on a fresh server",
}
WATCH_INTERVAL_S = 0.5


ENVIRONMENT = """environment (settings no YAML key holds: they belong to a machine or a debugging session):
  PDSERVE_CACHE=DIR         where the built `tiny` model and the compiled CPU kernels are kept
                            (default ~/.cache/pdserve); the workers get the same value
  KVTRANSFER_ADDRESS=IP     the address a worker's KV agent advertises to its peers and listens on (default:
                            its Ray node's address; the loopback on a single-host server)
  PDSERVE_KV_FAULTS=SPEC    transfer faults for tests and drills, e.g. "fail=0.05,stall=0.01:2.0,seed=7"
                            (the YAML's `faults:` and POST /admin/faults are the serving way)
  PDSERVE_PDL=0             the decode step's kernels launch without programmatic dependent launch on Hopper
                            GPUs (on by default there; docs/engine.md); the workers get the same value
  PDSERVE_TRACE_HANDOFF=1   every KV handoff prints its stages as JSON lines on stderr
                            (benchmarks/handoff_serving.py reads them)
  PDSERVE_LAUNCHED_AT=T     set by `pdserve serve` for its coordinator (wall-clock seconds of its launch): the
                            log's start-up milestones say how long after it they came"""


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help=COMMANDS["serve"], description=COMMANDS["serve"], epilog=ENVIRONMENT,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("config", help="YAML config, e.g. configs/default.yaml")
    serve.add_argument("--host", help="overrides server.host")
    serve.add_argument("--port", type=int, help="overrides server.port")
    serve.add_argument("--ray-address", help="'auto' to join the running Ray cluster; default: the config's")
    stop = sub.add_parser("stop", help=COMMANDS["stop"], description=COMMANDS["stop"])
    stop.add_argument("config", help="the YAML config the server was started with")
    stop.add_argument("--host", help="overrides server.host, as given to serve")
    stop.add_argument("--port", type=int, help="overrides server.port, as given to serve")
    stop.add_argument("--ray-address", help="as given to serve: with a cluster it joined, workers left by a server "
                      "that is gone are removed from it")


def _top_parser() -> argparse.ArgumentParser:
    """Lists every command; each command's own parser (and `--help`) lives with the command."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["bench"], ["sweep"]):
        return _bench_main(argv)
    if argv[:1] == ["generate"]:
        from engine import cli as engine_cli  # lazy: imports torch
        return engine_cli.main(argv)
    if argv[:1] == ["_coordinator"]:
        return coordinator_main(argv[1:])
    if argv[:1] not in (["serve"], ["stop"]):
        _top_parser().parse_args(argv)  # prints the help or the usage error, and exits
        return 2
    parser = argparse.ArgumentParser(prog="pdserve")
    _serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return _serve_main(args) if args.command == "serve" else _stop_main(args)


def _load(args: argparse.Namespace):
    """The validated config with the command line's overrides, and those overrides; None after printing why not."""
    from coordinator.config.config_checks import check_tensor_parallel
    from coordinator.config.serve_config import load_serve_config
    from engine.config_error import ConfigError
    overrides = {k: v for k, v in (("server.host", args.host), ("server.port", args.port),
                                   ("ray_address", args.ray_address)) if v is not None}
    try:
        config = load_serve_config(args.config, overrides)
        check_tensor_parallel(config, args.config)
    except ConfigError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return None
    return config, overrides


def _serve_main(args: argparse.Namespace) -> int:
    loaded = _load(args)
    if loaded is None:
        return 2
    config, _ = loaded
    from coordinator.process_supervisor import ProcessSupervisor, absolute_path
    folder = absolute_path(config.model)  # the folder the supervisor hands its coordinator and workers
    if config.model != "tiny" and not os.path.isdir(folder):  # before anything starts
        print(f"pdserve: error: {args.config}: model {config.model!r}: no such checkpoint folder {folder} (a relative "
              "path is taken from the directory pdserve serve runs in)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from coordinator.api.listener import ListenError, bind_listener
    try:  # bound before anything starts: a port in use fails in a second
        listener = bind_listener(config.server.host, config.server.port)
    except ListenError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 3
    start_watchdog()  # its pipe closes when this process has ended, after Ray's own exit handlers
    return ProcessSupervisor(config, listener).run()


def coordinator_main(argv: list[str]) -> int:
    """The coordinator under `pdserve serve`'s supervisor: STATE_DIR LISTEN_FD READY_FD local|joined. It runs with the
    configuration the supervisor froze at start (STATE_DIR's CHILD_CONFIG, never the YAML file as it is now), joins
    the supervisor's Ray in its namespace, serves on the inherited socket and writes a byte to READY_FD once it
    serves."""
    import pickle
    import socket
    from pathlib import Path

    from coordinator.process_supervisor import CHILD_CONFIG
    from engine.config_error import ConfigError
    state_dir, listen_fd, ready_fd, ray_kind = argv
    config = pickle.loads((Path(state_dir) / CHILD_CONFIG).read_bytes())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    import ray

    from coordinator.backend.ray_start import init_ray
    from coordinator.serve import serve
    start_watchdog()  # its own tree (HTTP frontend processes); Ray's processes are the supervisor's
    if ray_kind == "local":  # the supervisor's own cluster: the workers inherit its environment already
        ray.init(address=config.ray_address, namespace=config.namespace, include_dashboard=False,
                 logging_level="WARNING")
    else:
        init_ray(config.ray_address, config.namespace)
    listener = socket.socket(fileno=int(listen_fd))

    async def run() -> None:
        ready = asyncio.Event()

        async def report() -> None:
            await ready.wait()
            os.write(int(ready_fd), b"1")
        reporter = asyncio.get_running_loop().create_task(report())
        try:
            await serve(config, ready, listener, state_dir)
        finally:
            reporter.cancel()
    try:
        asyncio.run(run())
    except Exception as e:  # noqa: BLE001 - Ray wraps a worker's error; only a ConfigError is reported here
        cause = getattr(e, "cause", e)  # a RayTaskError carries the worker's own exception as `cause`
        if not isinstance(cause, ConfigError):
            raise
        # a checkpoint or setting a worker refused (engine.model.checkpoint_checks): one line, not a traceback
        print(f"pdserve: error: a worker could not start: {cause}", file=sys.stderr)
        return 2
    return 0


def _stop_main(args: argparse.Namespace) -> int:
    """SIGTERM to the server's supervisor (found by its namespace's pid file, trusted only while the supervisor holds
    its lock: coordinator.process_supervisor.supervisor_pid), then wait for it; with no server running and a joined
    cluster, remove what is left of its namespace there."""
    loaded = _load(args)
    if loaded is None:
        return 2
    config, _ = loaded
    from coordinator.backend.fleet import default_namespace
    from coordinator.process_supervisor import pid_file, supervisor_pid
    if config.namespace is None and not config.server.port:
        print("pdserve: error: server.port 0 names no namespace: give the server's --port (or set namespace)",
              file=sys.stderr)
        return 2
    namespace = config.namespace or default_namespace(config.server.port)
    path = pid_file(namespace)
    pid = supervisor_pid(path)  # only a pid whose supervisor still holds the file's lock is signalled
    if pid is None and path.exists():
        print(f"pdserve: ignoring the stale pid file {path}: no pdserve serve holds it (its server was killed); "
              "the pid in it is not signalled", file=sys.stderr)
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + config.server.drain_timeout_s + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            print(f"pdserve: error: the server (pid {pid}) did not stop; it is still draining or hung",
                  file=sys.stderr)
            return 1
        print(f"pdserve: stopped the server of namespace {namespace} (pid {pid})")
        return 0
    if config.ray_address is None:
        print(f"pdserve: no server of namespace {namespace} is running (its local Ray ended with it)")
        return 0
    import ray

    from coordinator.backend.fleet import teardown
    ray.init(address=config.ray_address, namespace=namespace, logging_level="WARNING")
    killed = asyncio.run(teardown("pdserve stop"))
    print(f"pdserve: no server of namespace {namespace} is running; removed {len(killed)} workers left in it")
    return 0


def _alive(pid: int) -> bool:
    return pid in _process_table()  # a zombie is gone


def start_watchdog() -> subprocess.Popen:
    """The watchdog of this process's tree; it ends when this process does (closing its stdin)."""
    code = "import sys; from coordinator.cli import watchdog_main; sys.exit(watchdog_main(int(sys.argv[1])))"
    return subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.PIPE,
                            start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _process_table() -> dict[int, tuple[int, int]]:
    """{pid: (ppid, start time in clock ticks)} of every live process, from /proc (zombies count as gone)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X"):
            table[int(name)] = (int(fields[1]), int(fields[19]))
    return table


def _descendants(root: int, table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """{pid: start time} of every process below `root` in `table`."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            stack.extend(children.get(pid, []))
    return found


def watchdog_main(server_pid: int) -> int:
    """Snapshot the server's tree every WATCH_INTERVAL_S until stdin ends, then kill what is left of it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's business; this ends after it
    me = os.getpid()
    known: dict[int, int] = {}
    while True:
        table = _process_table()
        if server_pid in table:
            known.update(_descendants(server_pid, table))
        if select.select([sys.stdin], [], [], WATCH_INTERVAL_S)[0] and not os.read(sys.stdin.fileno(), 64):
            break  # EOF: the server exited or was killed
    table = _process_table()
    alive = {pid for pid, start in known.items() if pid != me and table.get(pid, (0, -1))[1] == start}
    for pid in list(alive):  # children spawned after the last snapshot by a process that is still alive
        alive |= {p for p in _descendants(pid, table) if p != me}
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0


def _bench_main(argv: list[str]) -> int:
    from benchclient import cli as bench_cli  # lazy: only the benchmark needs httpx (and matplotlib for sweeps)
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.add_bench_parser(sub)
    bench_cli.add_sweep_parser(sub)
    args = parser.parse_args(argv)
    return bench_cli.bench_main(args) if args.command == "bench" else bench_cli.sweep_main(args)


if __name__ == "__main__":
    sys.exit(main())
