"""Real Ray clusters for the cluster tests, each in its own Linux namespaces so that nothing can leak or collide.

`run_isolated(scenario, workdir)` runs `python -m tests.cluster_helpers SCENARIO WORKDIR` under
`unshare --pid --net --mount --kill-child`: a network namespace with only loopback (Ray, SSH and HTTP use
127.0.0.1 and Ray's default ports without meeting another cluster on the machine), a PID namespace (`ray stop`,
which `ray up` and `ray down` run, stops only this scenario's Ray; when the scenario ends or is killed on timeout,
the kernel kills every process left in it) and a mount namespace with a private /tmp/ray (where Ray keeps
sessions and finds the running cluster) and /tmp/pdserve (pdserve serve's pid files, named by host and port: the
same in every scenario). The scenario writes what it saw to WORKDIR/result.json; the tests assert
on it. HOME is WORKDIR/home inside, so the cluster token (~/.ray/auth_token), Ray's files and the server's log
and pid stay in the test's directory. Needs root (namespaces, sshd); CI runs as root.

A second Ray node can run as if on its own machine (`start_node`): `ray start --block` as PID 1 of nested PID and
mount namespaces, with its own /tmp/ray, so stopping it (`Node.stop_raylet`, `Node.ray_stop`) takes down that
node's Ray and nothing else.
A scenario is a name in SCENARIOS or `module:function` (a function taking the work dir, returning JSON data).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import hashlib
import importlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tests.listening_sockets import listening_sockets

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
PROMPT = [11, 300, 42, 7, 1999, 5, 123, 64, 8, 250, 19, 3]   # token ids of the `tiny` model's vocabulary
MAX_TOKENS = 16
HALF_CPU = {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20}
SERVER_PORT = 8000   # free: the scenario has its own network namespace
CLUSTER_NAME = "pdserve-test"
CLUSTER_ADMIN_KEY = "pdserve-cluster-test-operator"  # the operator key of the servers these scenarios start


def isolation_unavailable() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (Linux namespaces and an SSH server); CI runs as root"
    missing = [tool for tool in ("unshare", "ip", "mount") if shutil.which(tool) is None]
    return f"missing {missing}" if missing else None


def ensure_ssh_tools() -> str | None:
    """The SSH server and rsync that `ray up` over SSH needs: installed with apt-get when missing (as .ci/run
    does), or the reason they cannot be."""
    missing = [pkg for pkg, tool in (("openssh-server", "sshd"), ("openssh-client", "ssh-keygen"), ("rsync", "rsync"))
               if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if not missing:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"missing {missing} and no apt-get as root to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        subprocess.run(cmd, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    return None


def run_isolated(scenario: str, workdir: Path, timeout_s: float) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "scenario.log"
    cmd = ["unshare", "--pid", "--net", "--mount", "--fork", "--mount-proc", "--kill-child",
           sys.executable, "-m", "tests.cluster_helpers", "init", scenario, str(workdir)]
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:  # run() has killed unshare; --kill-child takes the namespace down
            raise AssertionError(f"{scenario} ran over {timeout_s:.0f} s; log:\n{log.read_text()[-6000:]}") from None
    if rc != 0:
        raise AssertionError(f"{scenario} failed ({rc}); log:\n{log.read_text()[-6000:]}")
    return json.loads((workdir / "result.json").read_text())


# ---- inside the namespaces ------------------------------------------------------------------------------------

def sh(cmd: list[str] | str, timeout_s: float = 120, env: dict | None = None, check: bool = True) -> str:
    print("+", cmd if isinstance(cmd, str) else " ".join(map(str, cmd)), flush=True)
    proc = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout_s,
                          env=env)
    output = proc.stdout + proc.stderr
    print(output[-3000:], flush=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{cmd} exited {proc.returncode}")
    return output


def enter_namespaces(workdir: Path) -> None:
    """Loopback up, a private /tmp/ray and /tmp/pdserve (pdserve serve's pid files: a scenario's server on port 8000
    is another machine's to a scenario running beside it, though the host name is the same), HOME in the work dir
    with the cluster's token, token auth on."""
    from coordinator.process_supervisor import pid_file

    sh(["ip", "link", "set", "lo", "up"])
    for private, where in (("ray-tmp", Path("/tmp/ray")), ("pdserve-tmp", pid_file("any").parent)):
        (workdir / private).mkdir(exist_ok=True)
        where.mkdir(parents=True, exist_ok=True)
        sh(["mount", "--bind", str(workdir / private), str(where)])
    home = workdir / "home"
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    os.environ.update(HOME=str(home), RAY_AUTH_MODE="token", PYTHONUNBUFFERED="1")


def wait_healthy(url: str, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} was not healthy within {timeout_s:.0f} s")


def stream_completion(url: str) -> dict:
    from tests.server_process import complete
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await complete(client, url, body)
    return asyncio.run(run())


async def stream_events(client: httpx.AsyncClient, url: str, body: dict,
                        on_text: Callable[[str], None] | None = None, timeout_s: float = 120) -> dict:
    """POST a streamed completion and record how it ended: status, Retry-After, text, usage, finish reason,
    in-band error, whether [DONE] came, or that it hung past `timeout_s`. `on_text(text so far)` per chunk."""
    out: dict = {"status": None, "retry_after": None, "text": "", "completion_tokens": None, "finish_reason": None,
                 "error": None, "done": False, "hung": False}

    async def run() -> None:
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", f"{url}/v1/completions", json=stream_body) as r:
            out.update(status=r.status_code, retry_after=r.headers.get("retry-after"))
            if r.status_code != 200:
                out["error"] = json.loads(await r.aread()).get("error")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    out["error"] = chunk.get("error", out["error"])
                    if chunk.get("usage"):
                        out["completion_tokens"] = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        out["text"] += choice["text"]
                        out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
                    if on_text is not None and chunk.get("choices"):
                        on_text(out["text"])
    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        out["hung"] = True
    return out


def transfer_metrics(url: str, timeout_s: float = 20) -> dict[str, float]:
    """pdserve_transfer_* from /metrics once they count a read or a write (the server refreshes them every second or
    so)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        found = {name: float(value) for name, value in (line.split()[:2] for line in text.splitlines()
                                                        if line.startswith("pdserve_transfer_"))}
        moved = found.get("pdserve_transfer_read_count", 0) + found.get("pdserve_transfer_write_count", 0)
        if moved >= 1 or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def live_processes() -> list[str]:
    """Command lines of every live process in this PID namespace but init (pid 1) and this one."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name in ("1", str(os.getpid())):
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())
        except (OSError, IndexError):
            continue
    return [c for c in found if c]


def wait_no_processes(timeout_s: float = 30, keep=lambda cmd: False) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = [c for c in live_processes() if not keep(c)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


_VIEW = """
import json, ray
from ray._private.state import actors
from ray.util import placement_group_table
ray.init(address="auto", logging_level="ERROR")
print("VIEW" + json.dumps({
    "nodes": {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]},
    "actors": [{"class_name": a["ActorClassName"], "node_id": a["Address"]["NodeID"], "pid": a["Pid"]}
               for a in actors().values() if a["State"] == "ALIVE"],
    "groups": {g["name"]: sorted(set(g["bundles_to_node_id"].values())) for g in placement_group_table().values()
               if g["state"] == "CREATED"},
}))
"""


def cluster_view(url: str | None = None) -> dict:
    """Ask Ray, from a second driver, which node each live actor and placement group runs on, and what each node
    offers (the GCS tables behind `ray list actors`; this minimal Ray has no dashboard for ray.util.state). With
    the server's `url`, each worker actor is named by its role on /health ("prefill", "decode") instead of its
    class (every worker is one class: pool_worker.worker.Worker)."""
    out = sh([sys.executable, "-c", _VIEW], timeout_s=60)
    view = json.loads(out.split("VIEW", 1)[1].splitlines()[0])
    if url is not None:
        health = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {CLUSTER_ADMIN_KEY}"}, timeout=10)
        roles = {w["pid"]: w["role"] for w in health.json()["workers"]}  # pids: the operator's view
        for actor in view["actors"]:
            actor["class_name"] = roles.get(actor["pid"], actor["class_name"])
    return view


NODE_ARGS = ["--node-ip-address=127.0.0.1", "--object-store-memory=100000000", "--disable-usage-stats"]


def start_head(resources: dict[str, float], num_cpus: float = 1, node_args: list[str] = NODE_ARGS,
               env: dict | None = None) -> None:
    sh([RAY, "start", "--head", "--port=6379", "--include-dashboard=false", f"--num-cpus={num_cpus}",
        "--resources", json.dumps(resources), *node_args], env=env)


# the two_nodes scenario's private network: a veth pair whose ends carry the head's and the second node's addresses
# (and the default route, by which Ray finds a driver's own address), as two machines' interfaces would
PRIVATE_DEVICES, PRIVATE_ADDRESSES = ("pd0", "pd1"), ("10.77.0.1", "10.77.0.2")
RAY_WORKER_PORTS = (20000, 20999)  # where Ray's core workers put their gRPC servers (every interface, Ray 2.60)


def private_network() -> None:
    first, second = PRIVATE_DEVICES
    sh(["mount", "-t", "sysfs", "sysfs", "/sys"])  # this network namespace's devices (UCX lists /sys/class/net)
    sh(["ip", "link", "add", first, "type", "veth", "peer", "name", second])
    for device, address in zip(PRIVATE_DEVICES, PRIVATE_ADDRESSES, strict=True):
        sh(["ip", "addr", "add", f"{address}/24", "dev", device])
        sh(["ip", "link", "set", device, "up"])
    sh(["ip", "route", "add", "default", "dev", first])


def private_node_args(address: str) -> list[str]:
    low, high = RAY_WORKER_PORTS
    return [f"--node-ip-address={address}", f"--min-worker-port={low}", f"--max-worker-port={high}",
            *NODE_ARGS[1:]]


@dataclass
class Node:
    """A worker node in its own PID and mount namespaces: `unshare`, whose child `ray start --block` is the
    namespace's PID 1 (when it exits, the kernel kills every process of the node)."""
    name: str
    unshare: subprocess.Popen
    log: Path

    def init_pid(self) -> int:
        children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children").read_text().split()
        return int(children[0])

    def pids(self, comm: str | None = None) -> list[int]:
        """This node's processes (PIDs as the scenario's namespace sees them), or only those named `comm`."""
        ns = os.readlink(f"/proc/{self.init_pid()}/ns/pid")
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.readlink(entry / "ns" / "pid") == ns and (
                        comm is None or (entry / "comm").read_text().strip() == comm):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def stop_raylet(self) -> float:
        """Stop the node's Ray as `ray stop` begins to, with SIGTERM to its raylet (which tells Ray the node is
        going), at once rather than after the CLI's start-up. Returns time.monotonic() of the signal."""
        (raylet,) = self.pids("raylet")
        stopped_at = time.monotonic()
        os.kill(raylet, signal.SIGTERM)
        return stopped_at

    def ray_stop(self, timeout_s: float = 60) -> None:
        """`ray stop` inside the node's namespaces (the rest of its Ray after stop_raylet()), then the end of
        `ray start --block`, which takes SIGTERM-ed children as a graceful exit and would keep waiting."""
        if self.unshare.poll() is not None:
            return
        sh(["nsenter", f"--target={self.init_pid()}", "--pid", "--mount", RAY, "stop"], timeout_s=timeout_s,
           check=False)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the kernel ends every process of the namespace with its PID 1
            with contextlib.suppress(OSError, IndexError):  # it has exited already
                os.kill(self.init_pid(), sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.unshare.wait(30)
                return
        raise RuntimeError(f"node {self.name} did not stop")


def start_node(workdir: Path, name: str, resources: dict[str, float], num_cpus: float = 1,
               timeout_s: float = 120) -> Node:
    """`ray start --address` of a node offering `resources`, as on a machine of its own (own /tmp/ray)."""
    tmp = workdir / f"{name}-ray-tmp"
    tmp.mkdir(parents=True)
    start = [RAY, "start", "--address=127.0.0.1:6379", "--block", f"--num-cpus={num_cpus}",
             "--resources", json.dumps(resources), *NODE_ARGS]
    script = f"mount --bind {shlex.quote(str(tmp))} /tmp/ray && exec {shlex.join(start)}"
    log = workdir / f"{name}.log"
    print("+ node", name, script, flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child",
                                 "sh", "-c", script], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"node {name} did not start: {_tail(log)}")
        time.sleep(0.5)
    return Node(name, proc, log)


@contextlib.contextmanager
def serving(workdir: Path, config: dict, exits: dict, name: str = "server") -> Iterator[str]:
    """`pdserve serve` joined to the running cluster with `config`, healthy; yields its URL. On exit it is
    stopped with SIGTERM and its exit status goes to exits[f"{name}_exit"] ("killed after 60 s" if it hung)."""
    config = {**config, "ray_address": "auto",
              "server": {"host": "127.0.0.1", "port": SERVER_PORT, "admin_api_key": CLUSTER_ADMIN_KEY}}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{SERVER_PORT}"
    with open(workdir / f"{name}.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", str(path)],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, 180, alive=lambda: server.poll() is None)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            exits[f"{name}_exit"] = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            exits[f"{name}_exit"] = "killed after 60 s"
        print(_tail(workdir / f"{name}.log"), flush=True)


def two_nodes(workdir: Path) -> dict:
    """A head offering `prefill_node` and a second node offering `decode_node`, each on its own address of a private
    network (private_network), pdserve serving on them with `transfer.net_devices` naming that network's devices
    and UCX's transports cut to TCP: KV crosses by TCP, between agents that connect by worker address. What the
    workers listen on is read while they serve."""
    private_network()
    head, second = PRIVATE_ADDRESSES
    tcp_only = {**os.environ, "UCX_TLS": "tcp"}
    start_head({"prefill_node": 4}, node_args=private_node_args(head), env=tcp_only)
    sh([RAY, "start", f"--address={head}:6379", "--num-cpus=1", "--resources", json.dumps({"decode_node": 4}),
        *private_node_args(second)], env=tcp_only)
    config = {"model": "tiny", "placement": "pack",
              "transfer": {"backends": ["ucx"], "net_devices": ",".join(PRIVATE_DEVICES)},
              "prefill": {**HALF_CPU, "resources": {"prefill_node": 1}},
              "decode": {**HALF_CPU, "resources": {"decode_node": 1}}}
    result: dict = {}
    with serving(workdir, config, result) as url:
        result.update(completion=stream_completion(url), transfer=transfer_metrics(url), **cluster_view(url))
        workers = {actor["pid"] for actor in result["actors"]}
        result["listening"] = listening_sockets(lambda pid: pid in workers)
    sh([RAY, "stop"], timeout_s=60)
    return {**result, "left_running": wait_no_processes()}


def start_sshd(workdir: Path) -> tuple[Path, Path]:
    """An SSH server on 127.0.0.1:22 of this namespace that lets root in with a throw-away key; HOME is set to
    the work dir's home for every session. Returns (private key, sshd pid file)."""
    ssh = workdir / "ssh"
    ssh.mkdir()
    sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "id_ed25519")])
    sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "host_ed25519")])
    shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
    (ssh / "sshd_config").write_text("\n".join([
        "Port 22", "ListenAddress 127.0.0.1", f"HostKey {ssh / 'host_ed25519'}",
        f"AuthorizedKeysFile {ssh / 'authorized_keys'}", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        f"PidFile {ssh / 'sshd.pid'}", f"SetEnv HOME={os.environ['HOME']}", ""]))
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory, as the package makes it
    sh([shutil.which("sshd") or "/usr/sbin/sshd", "-f", str(ssh / "sshd_config"), "-E", str(ssh / "sshd.log")])
    return ssh / "id_ed25519", ssh / "sshd.pid"


def local_cluster_config(workdir: Path, key: Path) -> Path:
    """configs/cluster-local.yaml pointed at this namespace's 127.0.0.1 and the throw-away key; else verbatim."""
    config = yaml.safe_load((ROOT / "configs" / "cluster-local.yaml").read_text())
    config["cluster_name"] = CLUSTER_NAME
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    path = workdir / "cluster-local.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def ray_up_local(workdir: Path) -> dict:
    """`ray up` over SSH to 127.0.0.1 with configs/cluster-local.yaml: it syncs this checkout to ~/pdserve, runs the
    setup (the venv is there: the repository's, linked), starts Ray and `pdserve serve` on the head; stream a
    completion over HTTP, stop the server with `ray exec`, `ray down`, stop sshd."""
    home = Path(os.environ["HOME"])
    (home / "pdserve").mkdir()
    (home / "pdserve" / ".venv").symlink_to(VENV_BIN.parent)  # this host has pdserve installed already
    (home / ".bashrc").write_text("")
    key, sshd_pid = start_sshd(workdir)
    cluster = str(local_cluster_config(workdir, key))
    ray_cli = [RAY]
    url = f"http://127.0.0.1:{SERVER_PORT}"
    result: dict = {}
    try:
        sh([*ray_cli, "up", "-y", "--no-config-cache", cluster], timeout_s=300, env={**os.environ, "TERM": "dumb"})
        result["synced"] = sorted(p.name for p in (home / "pdserve").iterdir())
        wait_healthy(url, 180)
        result["completion"] = stream_completion(url)
        result["ray_status"] = sh([*ray_cli, "exec", "--no-config-cache", cluster,
                                   "RAY_AUTH_MODE=token ~/pdserve/.venv/bin/ray status"], timeout_s=60)
        # (300 lines: after the coordinator drains, the supervisor tears the namespace down and Ray logs its end)
        stop = ("kill -TERM $(cat ~/pdserve-serve.pid) && while kill -0 $(cat ~/pdserve-serve.pid) 2>/dev/null; "
                "do sleep 1; done; tail -n 300 ~/pdserve-serve.log")
        result["stop_output"] = sh([*ray_cli, "exec", "--no-config-cache", cluster, stop], timeout_s=120)
        result["server_still_answers"] = _answers(url)
    finally:
        print(_tail(home / "pdserve-serve.log"), flush=True)
        result["down"] = sh([*ray_cli, "down", "-y", cluster], timeout_s=120, check=False)
        if sshd_pid.exists():
            os.kill(int(sshd_pid.read_text()), signal.SIGTERM)
    result["left_running"] = wait_no_processes(30)
    forget_ray_client_files(workdir, CLUSTER_NAME)
    return result


def forget_ray_client_files(workdir: Path, cluster_name: str) -> None:
    """Remove what the ray CLI keeps in /tmp for this test's cluster: its resolved-config cache (it names the
    work dir) and its SSH control-socket folder (named by hashes of the user and the cluster name)."""
    from ray.autoscaler._private.command_runner import HASH_MAX_LENGTH
    for cache in Path(tempfile.gettempdir()).glob("ray-config-*"):
        if str(workdir) in cache.read_text(errors="replace"):
            cache.unlink()
    user, cluster = (hashlib.sha256(name.encode()).hexdigest()[:HASH_MAX_LENGTH]
                     for name in (getpass.getuser(), cluster_name))
    control = Path("/tmp") / f"ray_ssh_{user}"
    shutil.rmtree(control / cluster, ignore_errors=True)
    if control.is_dir() and not any(control.iterdir()):
        control.rmdir()


def _tail(log: Path, chars: int = 3000) -> str:
    return f"--- {log} ---\n" + (log.read_text(errors="replace")[-chars:] if log.exists() else "(none)")


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


SCENARIOS = {"two_nodes": two_nodes, "ray_up_local": ray_up_local}


def _scenario(name: str) -> Callable[[Path], dict]:
    if ":" not in name:
        return SCENARIOS[name]
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def init(argv: list[str]) -> int:
    """PID 1 of the namespace: run the scenario as a child and reap every process orphaned to us (Ray's daemons
    when `ray stop` ends them), so none lingers as a zombie; the scenario's exit status is ours."""
    child = subprocess.Popen([sys.executable, "-m", "tests.cluster_helpers", *argv])
    while True:
        pid, status = os.wait()
        if pid == child.pid:
            return os.waitstatus_to_exitcode(status)


def main() -> None:
    if sys.argv[1] == "init":
        sys.exit(init(sys.argv[2:]))
    scenario, workdir = sys.argv[1], Path(sys.argv[2])
    enter_namespaces(workdir)
    result = _scenario(scenario)(workdir)
    (workdir / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
