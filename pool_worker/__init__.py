"""The worker actor: one engine on one GPU (or a tensor-parallel group, or CPUs) inside a Ray actor, with what every
worker needs once (engine start, KV agents, the coordinator's stream, health, metrics, drills) and both duties a
request can give it: prefill for another worker (prefill_pool.prefills) and decode (decode_pool.decodes). A
worker's role is what the coordinator sends it, so it can change while serving.

May import: prefill_pool, decode_pool, kvtransfer, engine."""

from pool_worker.start_phases import IMPORT_STARTED  # noqa: F401 - first: when the worker code began to import
