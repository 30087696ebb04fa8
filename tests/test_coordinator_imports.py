"""The coordinator process imports no torch: it only configures workers and starts actors from their classes, and
torch (with the engine and the KV agents) costs ~2.5 s of every server start on the 2-core machine. The workers
import it in their own processes (their start())."""

import subprocess
import sys

MODULES = ("coordinator.cli", "coordinator.serve", "coordinator.backend.ray_backend", "coordinator.backend.pools",
           "pool_worker.worker", "kvtransfer.errors")


def test_the_coordinator_modules_and_the_worker_classes_import_without_torch():
    code = (f"import sys\nfor m in {MODULES!r}: __import__(m)\n"
            "from kvtransfer import AgentConfig, PeerLost, TransferTimeout\n"
            "from engine.tiny import resolve_model_path\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_lazy_kvtransfer_exports_resolve():
    import kvtransfer
    for name in kvtransfer.__all__:
        assert getattr(kvtransfer, name) is not None, name
