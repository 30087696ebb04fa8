"""`pdserve stop` signals only a live `pdserve serve` supervisor: the pid file counts only while the process that
wrote it holds its lock (coordinator.process_supervisor.hold_pid_file). A stale file (its supervisor SIGKILLed, the
pid since taken by anyone) is ignored with a message and the process it names survives. Real processes, the real
CLI; a whole server's `pdserve stop` is tests/test_coordinator_restart.py's."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from coordinator.process_supervisor import pid_file

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path) -> tuple[Path, Path]:
    """A config naming a namespace of its own (no server runs in it), and its pid file's path."""
    namespace = f"pdserve-stop-test-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "namespace": namespace, "server": {"port": 1}}))
    return path, pid_file(namespace)


def _stop(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "stop", str(config)], capture_output=True,
                          text=True, timeout=90)


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def test_a_stale_pid_file_is_ignored_and_the_process_it_names_survives(tmp_path):
    config, path = _config(tmp_path)
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(bystander.pid))  # as a SIGKILLed supervisor leaves it, its pid since reused
        stop = _stop(config)
        assert stop.returncode == 0, stop.stderr
        assert "stale pid file" in stop.stderr and "stopped the server" not in stop.stdout, (stop.stdout, stop.stderr)
        time.sleep(0.5)  # a SIGTERM, had one been sent, is delivered by now
        assert _alive(bystander)
    finally:
        bystander.kill()
        bystander.wait()
        path.unlink(missing_ok=True)


def test_the_process_that_holds_the_pid_file_is_stopped(tmp_path):
    config, path = _config(tmp_path)
    code = ("import sys, time; from pathlib import Path; from coordinator.process_supervisor import hold_pid_file; "
            "held = hold_pid_file(Path(sys.argv[1])); print('held', flush=True); time.sleep(300)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        assert path.read_text() == str(holder.pid)
        stop = _stop(config)
        assert stop.returncode == 0, stop.stderr
        assert f"stopped the server of namespace {path.stem} (pid {holder.pid})" in stop.stdout
        assert holder.wait(30) == -signal.SIGTERM
    finally:
        if _alive(holder):
            holder.kill()
            holder.wait()
        path.unlink(missing_ok=True)


def test_a_second_supervisor_of_the_same_namespace_is_refused(tmp_path):
    from coordinator.process_supervisor import hold_pid_file
    _, path = _config(tmp_path)
    held = hold_pid_file(path)
    try:
        with pytest.raises(RuntimeError, match="a server of this namespace is running"):
            hold_pid_file(path)
        assert path.read_text() == str(os.getpid())  # the first holder's pid is left as it was
    finally:
        held.close()
        path.unlink(missing_ok=True)
