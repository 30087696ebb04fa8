"""The `tenants:` section of a serving config: who may call (API keys), each tenant's limits, priority class and
stream interval, validated once and frozen (TenantConfig, TenantsConfig) by `parse_tenants`. What the server does
with them at run time (authentication, token buckets, usage) is coordinator.admission.tenants.

    tenants:                           # a list, or a mapping by name
      - {name: acme, api_keys: [sk-1, sk-2], requests_per_minute: 600, tokens_per_minute: 200000, priority: high}

Limits absent or null are unlimited; priority is high, normal (default) or low (PRIORITY_CLASSES: admission order
numbers, lower first; 0 is the coordinator's own, for migrations); `stream_interval` (tokens per streamed chunk)
overrides `server.stream_interval` for the tenant's requests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from os import PathLike
from typing import Any

from engine.config_error import ConfigError

PRIORITY_CLASSES: dict[str, int] = {"high": 1, "normal": 2, "low": 3}
LOWEST_PRIORITY = max(PRIORITY_CLASSES.values())
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # also a metrics label value


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _limit(x: object) -> bool:
    return x is None or (is_int(x) and x > 0)


@dataclass(frozen=True)
class TenantConfig:
    name: str
    api_keys: tuple[str, ...] = ()
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    priority: str = "normal"
    stream_interval: int | None = None  # tokens per streamed chunk for this tenant (None: server.stream_interval)

    def __post_init__(self) -> None:
        keys = self.api_keys
        checks = [
            ("name", isinstance(self.name, str) and bool(_NAME.fullmatch(self.name)),
             "must be letters, digits, '_', '.' or '-' (starting with a letter or digit)"),
            ("api_keys", isinstance(keys, tuple) and all(isinstance(k, str) and k and k.split() == [k] for k in keys)
             and len(set(keys)) == len(keys), "must be distinct non-empty strings without whitespace"),
            ("requests_per_minute", _limit(self.requests_per_minute), "must be a positive integer or None"),
            ("tokens_per_minute", _limit(self.tokens_per_minute), "must be a positive integer or None"),
            ("priority", self.priority in PRIORITY_CLASSES, f"must be one of {tuple(PRIORITY_CLASSES)}"),
            ("stream_interval", self.stream_interval is None or (
                is_int(self.stream_interval) and 1 <= self.stream_interval <= 1024),
             "must be None or an integer in [1, 1024]"),
        ]
        for name, ok, why in checks:
            if not ok:
                shown = "<hidden>" if name == "api_keys" else repr(getattr(self, name))  # keys are secrets
                raise ValueError(f"TenantConfig.{name} {why}, got {shown}")


@dataclass(frozen=True)
class TenantsConfig:
    tenants: tuple[TenantConfig, ...] = ()

    def __post_init__(self) -> None:
        owner: dict[str, str] = {}
        for i, tenant in enumerate(self.tenants):
            if tenant.name in (t.name for t in self.tenants[:i]):
                raise ValueError(f"TenantsConfig.tenants: the name {tenant.name!r} is used twice")
            if not tenant.api_keys:
                raise ValueError(f"TenantsConfig.tenants: tenant {tenant.name!r} needs at least one key in api_keys")
            for key in tenant.api_keys:
                if key in owner:
                    raise ValueError(f"TenantsConfig.tenants: tenants {owner[key]!r} and {tenant.name!r} share an "
                                     "API key; keys must be unique across tenants")
                owner[key] = tenant.name


def parse_tenants(raw: Any, path: str | PathLike = "config") -> TenantsConfig:
    """The YAML `tenants:` section (a list of tenants, a mapping by name, or null) -> TenantsConfig; a
    ConfigError names the file, the tenant and the key."""
    if raw is None:
        return TenantsConfig()
    if isinstance(raw, dict):
        items = [(f"tenants.{name}", {"name": name, **body} if isinstance(body, dict) else body)
                 for name, body in raw.items()]
    elif isinstance(raw, list):
        items = [(f"tenants.{body['name']}" if isinstance(body, dict) and "name" in body else f"tenants[{i}]", body)
                 for i, body in enumerate(raw)]
    else:
        raise ConfigError(f"{path}: 'tenants' must be a list or a mapping of tenants, got a {type(raw).__name__}")
    known = [f.name for f in fields(TenantConfig)]
    tenants = []
    for where, body in items:
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: {where} must be a mapping of keys, got a {type(body).__name__}")
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise ConfigError(f"{path}: unknown key '{where}.{unknown[0]}'; known keys here: {known}")
        if "name" not in body:
            raise ConfigError(f"{path}: {where}: every tenant needs a name")
        values = dict(body)
        keys = values.get("api_keys", ())
        values["api_keys"] = (keys,) if isinstance(keys, str) else tuple(keys) if isinstance(keys, list) else keys
        try:
            tenants.append(TenantConfig(**values))
        except ValueError as e:
            raise ConfigError(f"{path}: {where}: {e}") from None
    try:
        return TenantsConfig(tuple(tenants))
    except ValueError as e:
        raise ConfigError(f"{path}: tenants: {e}") from None
