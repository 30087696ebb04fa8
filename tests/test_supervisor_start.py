"""`pdserve serve`'s supervisor starts the first coordinator beside Ray (coordinator.process_supervisor): the child
imports its HTTP side while Ray starts and reads its configuration only when told. If Ray cannot be started or
joined, that child ends with the supervisor (the pipe it waits on closes) and nothing is left behind. A real child
process; Ray's start is the one part replaced, by a failure."""

import socket
import uuid

import pytest

import coordinator.backend.ray_start as ray_start
from coordinator.config.serve_config import load_serve_config
from coordinator.process_supervisor import ProcessSupervisor, pid_file

pytestmark = pytest.mark.timeout(120)


def test_the_coordinator_started_beside_ray_ends_when_ray_cannot_start(tmp_path, monkeypatch):
    path = tmp_path / "serve.yaml"
    namespace = f"pdserve-start-test-{uuid.uuid4().hex[:8]}"
    path.write_text(f"model: tiny\nnamespace: {namespace}\nray_address: 127.0.0.1:1\n")
    config = load_serve_config(path)

    def refuse(address, namespace=None):
        raise ConnectionError(f"no Ray at {address}")
    monkeypatch.setattr(ray_start, "init_ray", refuse)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        supervisor = ProcessSupervisor(config, listener)
        with pytest.raises(ConnectionError, match="no Ray at 127.0.0.1:1"):
            supervisor.run()
    child = supervisor._child
    assert child is not None and child.wait(timeout=60) == 0  # it saw the pipe close and left without serving
    assert not pid_file(namespace).exists()
