"""Injected transfer faults, for tests and operators' drills: what to inject (`FaultConfig`) and the per-agent
decision of which transfer gets which fault (`FaultInjector`).

A `FaultConfig` comes from `AgentConfig.faults`, from `KVAgent.set_faults()` at run time, or, when the
AgentConfig carries none, from the environment variable `PDSERVE_KV_FAULTS`, e.g.
`PDSERVE_KV_FAULTS="fail=0.05,stall=0.01:2.0,drop=100,seed=7"` (see `FaultConfig.parse`).
Only the transfers an agent starts (`read` / `write`) are subject to faults; notifications and the transfers
it serves for its peers are not. Decisions come from the injector's own seeded RNG, drawn in submission order,
so one agent given the same config and the same sequence of transfers fails the same ones.
"""

from __future__ import annotations

import math
import os
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV_VAR = "PDSERVE_KV_FAULTS"

# short names accepted in PDSERVE_KV_FAULTS, besides the field names themselves
_SHORT = {"fail": "fail_fraction", "drop": "drop_peer_after", "seed": "seed"}


@dataclass(frozen=True)
class FaultConfig:
    """What to inject. All off by default.

    fail_fraction:   fraction of transfers that fail at once with TransferError, before any byte moves.
    stall_fraction:  fraction of the other transfers held back `stall_s` seconds before they start; a stall that
                     reaches the transfer's deadline ends it with TransferTimeout at that deadline.
    drop_peer_after: after this many transfers with one peer (0: never), the agent drops that peer: the
                     connection is aborted, transfers in flight with it and every later one fail with PeerLost,
                     until the peer is added again (`add_remote`, which also restarts the count).
    seed:            seed of the agent's fault RNG.
    """

    fail_fraction: float = 0.0
    stall_fraction: float = 0.0
    stall_s: float = 0.0
    drop_peer_after: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_fraction", "stall_fraction"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultConfig.{name} must be a number in [0, 1], got {value!r}")
        if not _is_number(self.stall_s) or not 0.0 <= self.stall_s < math.inf:
            raise ValueError(f"FaultConfig.stall_s must be a finite number >= 0, got {self.stall_s!r}")
        if not _is_int(self.drop_peer_after) or self.drop_peer_after < 0:
            raise ValueError(f"FaultConfig.drop_peer_after must be an integer >= 0 (0: never), "
                             f"got {self.drop_peer_after!r}")
        if not _is_int(self.seed):
            raise ValueError(f"FaultConfig.seed must be an integer, got {self.seed!r}")

    @property
    def active(self) -> bool:
        return self.fail_fraction > 0 or (self.stall_fraction > 0 and self.stall_s > 0) or self.drop_peer_after > 0

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> FaultConfig:
        """From a mapping of field names (a YAML `transfer.faults:` section, a pool's set_faults argument)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"FaultConfig has no field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
        return cls(**d)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str, source: str = ENV_VAR) -> FaultConfig:
        """`key=value` pairs separated by commas: fail=F, stall=F:S (fraction:seconds), drop=N, seed=N; the
        field names (fail_fraction, stall_fraction, stall_s, drop_peer_after, seed) work as keys too.
        Errors name `source` and the field."""
        values: dict[str, object] = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or not raw:
                raise ValueError(f"{source}: {item!r} is not key=value (e.g. fail=0.05,stall=0.01:2.0,seed=7)")
            if key == "stall":
                frac, colon, secs = raw.partition(":")
                if not colon:
                    raise ValueError(f"{source}: field 'stall' must be FRACTION:SECONDS (e.g. stall=0.01:2.0), "
                                     f"got {raw!r}")
                values["stall_fraction"] = _number(source, "stall", frac, float)
                values["stall_s"] = _number(source, "stall", secs, float)
                continue
            name = _SHORT.get(key, key)
            kind = {"drop_peer_after": int, "seed": int}.get(name, float)
            if name not in {f.name for f in fields(cls)}:
                raise ValueError(f"{source}: unknown field {key!r} (known: fail, stall, drop, seed, or the "
                                 f"FaultConfig field names)")
            values[name] = _number(source, key, raw, kind)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultConfig | None:
        """The config in $PDSERVE_KV_FAULTS, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        return cls.parse(text) if text else None


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(source: str, key: str, raw: str, kind: type) -> float | int:
    try:
        return kind(raw.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{source}: field {key!r} must be {what}, got {raw.strip()!r}") from None


@dataclass(frozen=True)
class Fault:
    """The fault one transfer gets: fail now, stall this long first, or drop the peer (at most one is set)."""

    fail: bool = False
    stall_s: float = 0.0
    drop: bool = False

    @property
    def none(self) -> bool:
        return not (self.fail or self.drop or self.stall_s > 0)


NO_FAULT = Fault()


class FaultInjector:
    """One per agent (and per set_faults call): its own RNG and its count of transfers per peer. Thread-safe:
    transfers are submitted from the caller's threads."""

    def __init__(self, config: FaultConfig | None) -> None:
        self.config = config or FaultConfig()
        self._rng = random.Random(self.config.seed)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def decide(self, peer: str) -> Fault:
        cfg = self.config
        if not cfg.active:
            return NO_FAULT
        with self._lock:
            n = self._counts[peer] = self._counts.get(peer, 0) + 1
            # both draws are taken for every transfer, so the draws of transfer k do not depend on the fractions
            u_fail, u_stall = self._rng.random(), self._rng.random()
        if cfg.drop_peer_after and n > cfg.drop_peer_after:
            return Fault(drop=True)
        if u_fail < cfg.fail_fraction:
            return Fault(fail=True)
        if u_stall < cfg.stall_fraction and cfg.stall_s > 0:
            return Fault(stall_s=cfg.stall_s)
        return NO_FAULT

    def forget(self, peer: str) -> None:
        """The peer was removed or replaced: its transfer count starts again."""
        with self._lock:
            self._counts.pop(peer, None)
