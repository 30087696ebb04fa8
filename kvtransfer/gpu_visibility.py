"""Which GPUs a worker process sees, set before CUDA starts: what the `cuda_ipc` backend needs.

Ray gives each `num_gpus=1` actor CUDA_VISIBLE_DEVICES = its own GPU. Then a peer's GPU is invisible, CUDA
IPC handles of its memory cannot be mapped with NVLink peer access, and the agent falls back to UCX
(measured on 2 H200: ~220 GB/s for 1 GiB instead of ~310 over cuda_ipc; docs/benchmark-log.md).
A tensor-parallel worker's follower processes inherit the list and put their own GPU first (`put_first`).
`expose_peer_gpus()` in the actor's __init__, before any CUDA call, shows every GPU of the Ray node with the
actor's own first: its GPU stays cuda:0 (for torch and for ucxx's progress thread, which makes its CUDA
context on device 0), and peers become reachable. The node's GPUs are those its Ray was started with: a server
started under CUDA_VISIBLE_DEVICES=2,3 (two servers on one 4-GPU host) has GPUs 2 and 3, not 0 and 1 (taking
0..n-1 once hid a worker's peer and showed it the other server's GPUs: its KV went the slow way).
"""

from __future__ import annotations

import os


def own_gpu(default: int = 0) -> int:
    """This Ray actor's GPU (physical id) if Ray assigned one, else `default`."""
    try:
        import ray

        ids = ray.get_gpu_ids() if ray.is_initialized() else []
    except ImportError:
        ids = []
    return int(ids[0]) if ids else default


def own_gpus() -> list[int]:
    """Every GPU (physical id) Ray assigned this actor, in Ray's order (a tensor-parallel worker has several)."""
    try:
        import ray

        return [int(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
    except ImportError:
        return []


def set_visible_gpus(own: int | list[int], gpus: list[int], visible: str = "all") -> None:
    """Before CUDA initializes: "all" shows the node's `gpus` (physical ids) with `own` (one id, or a TP worker's
    ids in rank order) first, "one" only `own`, "ray" leaves CUDA_VISIBLE_DEVICES as it is."""
    if visible == "ray":
        return
    own = [own] if isinstance(own, int) else list(own)
    order = own + [i for i in gpus if i not in own] if visible == "all" else own
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in order)


def expose_peer_gpus(gpus: list[int]) -> list[int]:
    """In a Ray actor, before CUDA starts: see the node's `gpus`, its own first (rank r of a TP worker stays
    cuda:r). Returns its own ids."""
    own = own_gpus() or [own_gpu()]
    set_visible_gpus(own, gpus, "all")
    return own


def put_first(index: int) -> int:
    """In a TP follower process, before CUDA starts: make visible GPU `index` cuda:0 (the others keep their
    order after it), so the ucxx progress thread's CUDA context (made on device 0) is on the rank's own GPU.
    Returns the rank's new device index: 0, or `index` when CUDA_VISIBLE_DEVICES is unset (left alone)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return index
    ids = visible.split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join([ids[index]] + ids[:index] + ids[index + 1:])
    return 0


def node_gpu_count() -> int:
    """GPUs of the Ray node this process runs on (0 outside Ray)."""
    import ray

    if not ray.is_initialized():
        return 0
    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    return int(node["Resources"].get("GPU", 0)) if node else 0


def node_gpus() -> list[int]:
    """The physical ids of the Ray node's GPUs: the CUDA_VISIBLE_DEVICES its raylet started with (a worker
    process inherits it, and Ray keeps it before setting the actor's own), else 0..n-1."""
    try:
        import ray._private.worker as ray_worker  # Ray keeps the inherited list here (no public API for it)

        started = ray_worker.global_worker.original_visible_accelerator_ids.get("GPU")
    except (ImportError, AttributeError):
        started = None
    if started:
        return [int(i) for i in started]
    return list(range(node_gpu_count()))


def uses_cuda_ipc(config) -> bool:
    """Whether an AgentConfig (or None: no agent) may move data over CUDA IPC."""
    return config is not None and "cuda_ipc" in config.backends
