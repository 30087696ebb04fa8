"""Fleet: the names that let the worker actors outlive the coordinator that started them.

With a namespace (ServeConfig.namespace; `pdserve serve` always sets one, coordinator.process_supervisor), every
worker is a detached, named actor `<role>-<index>@<incarnation>` and each pool's placement group a detached group
named `pdserve-<role>`, all in that Ray namespace: a coordinator that dies leaves them running, and the next one
finds them by name (coordinator.backend.adoption). Every worker carries the fleet's fingerprint: a hash of what the
actors were started with (the model, each pool's size, bundle and engine config, the transfer agents' config, the
mode and placement); a fleet whose workers carry another one is not adopted but torn down.
`teardown()` kills every actor and removes every placement group of the current namespace (`pdserve stop`, a
fleet that does not match, and the supervisor's last word after SIGTERM).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import socket
from dataclasses import replace

import ray
from ray.util.placement_group import get_placement_group, remove_placement_group

from coordinator.config.serve_config import ServeConfig

log = logging.getLogger("pdserve")
ROLES = ("prefill", "decode")
_NAME = re.compile(r"^(prefill|decode)-(\d+)@(\d+)$")
SHUTDOWN_TIMEOUT_S = 10.0


def default_namespace(port: int) -> str:
    """The namespace of a server that names none: its host and listening port (no two servers on one machine
    listen on the same port, so their fleets never meet, even in one Ray cluster)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    return f"pdserve-{host}-{port}"


def actor_name(role: str, index: int, incarnation: int) -> str:
    return f"{role}-{index}@{incarnation}"


def parse_actor_name(name: str) -> tuple[str, int, int] | None:
    """(pool, slot index, incarnation) of one of our actors' names; None for any other name."""
    m = _NAME.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), int(m.group(3)))


def group_name(role: str) -> str:
    return f"pdserve-{role}"


def fingerprint(config: ServeConfig, pools: tuple[str, ...]) -> str:
    """What the fleet's actors were started with, hashed: two coordinators with the same fingerprint may share
    workers. (Server, admission-queue, recovery and tenant settings are the coordinator's and may change.)"""
    parts = [config.mode, config.placement, repr(config.transfer.backends), repr(config.transfer.timeout_s),
             repr(config.admission.timeout_s)]
    for role in pools:
        pool = getattr(config, role)  # (the sizes the scaler may take it to are the coordinator's)
        parts += [role, repr(replace(pool, min_workers=None, max_workers=None)), repr(config.engine_config(pool))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def named_workers() -> dict[tuple[str, int], list[tuple[int, str]]]:
    """Our live named actors in the current namespace: {(pool, slot index): [(incarnation, name)], newest first}."""
    found: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for name in ray.util.list_named_actors():
        parsed = parse_actor_name(name)
        if parsed is not None:
            role, index, incarnation = parsed
            found.setdefault((role, index), []).append((incarnation, name))
    for entries in found.values():
        entries.sort(reverse=True)
    return found


def existing_group(role: str):
    """The placement group `pdserve-<role>` of the current namespace, or None."""
    try:
        return get_placement_group(group_name(role))
    except ValueError:  # Ray: "Failed to look up placement group with name ..."
        return None


async def teardown(reason: str) -> list[str]:
    """Shut down and kill every actor of the current namespace and remove its pools' placement groups; the names
    of the actors killed."""
    names = list(ray.util.list_named_actors())
    handles = []
    for name in names:
        try:
            handles.append(ray.get_actor(name))
        except ValueError:  # gone meanwhile
            continue
    if handles:
        log.warning("tearing down %d workers of namespace %s: %s", len(handles),
                    ray.get_runtime_context().namespace, reason)
        shutdowns = [h.shutdown.remote() for h in handles if hasattr(h, "shutdown")]
        try:  # their transfer agents close cleanly first (best effort: a hung one is killed anyway)
            await asyncio.wait_for(asyncio.gather(*shutdowns, return_exceptions=True), SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            pass
        for handle in handles:
            ray.kill(handle, no_restart=True)
    for role in ROLES:
        group = existing_group(role)
        while group is not None:  # a crash between two starts may have left more than one of a name
            remove_placement_group(group)
            await asyncio.sleep(0.05)
            nxt = existing_group(role)
            group = None if nxt is None or nxt.id == group.id else nxt
    return names
