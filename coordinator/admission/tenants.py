"""Tenants: the `tenants:` config section, API-key authentication, per-tenant rate limits, priority and usage.

    tenants:                           # a list, or a mapping by name
      - {name: acme, api_keys: [sk-1, sk-2], requests_per_minute: 600, tokens_per_minute: 200000, priority: high}

Limits absent or null are unlimited; priority is high, normal (default) or low; `stream_interval` (tokens per
streamed chunk) overrides `server.stream_interval` for the tenant's requests (e.g. a bulk tenant's, so its flood
costs the coordinator less per token). With tenants configured their keys are the auth (no key, a malformed
header or an unknown key: 401; no anonymous tenant; `server.api_key` may not be set too). With none, all is as
before: one unlimited tenant "default" (normal), behind `server.api_key` when set.
A key's SHA-256 digest is compared (hmac.compare_digest) with every configured key's, with no early exit.

Limits are token buckets, full at start and refilled continuously (per_minute / 60 per second, never above
per_minute) by the injected monotonic clock. A tenant is charged what its requests used, not what they might use
(issue 38: a chat request without max_tokens may generate up to the whole context window): a request costs 1 from
the requests bucket, and at admission prompt + min(max_tokens, `upfront_output_tokens`) from the tokens bucket;
`Grant.settle(completion_tokens)` corrects that to prompt + actual completion (giving back the unused part, or
charging the tokens generated beyond it: the bucket may then go below zero, a debt its refill pays before the
tenant's next request is admitted; the prompt too comes back if it was never processed). A request is charged only
if both buckets hold its admission cost, else 429 in OpenAI's shape (type "requests" or "tokens", code
"rate_limit_exceeded") with Retry-After: the seconds until the refusing bucket holds enough. An admission cost above
tokens_per_minute (a prompt too long for the limit): 400 at once.

Priority: admission order numbers, lower first (PRIORITY_CLASSES; 0 is the coordinator's own, for migrations). A
request's `priority` (a class name, or an int, lower is earlier as in vLLM) may lower its priority, never raise it
above its tenant's class: it is clamped into [tenant's class, "low"]. Not thread-safe: the event loop's only.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
from collections.abc import Callable

from coordinator import errors
from coordinator.config.tenants_config import LOWEST_PRIORITY, PRIORITY_CLASSES, TenantConfig, TenantsConfig, is_int
from coordinator.errors import APIError

_OUTCOME = re.compile(r"[a-z][a-z0-9_]*")
UPFRONT_OUTPUT_TOKENS = 256  # output tokens charged at admission, before the request has generated any


def check_count(name: str, value: object) -> None:
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def rate_limited(tenant: str, kind: str, limit: int, requested: int, retry_after_s: float) -> APIError:
    """429 in OpenAI's shape; `kind` is "requests" or "tokens" (the body's type, as OpenAI sends it)."""
    wait = max(1, math.ceil(retry_after_s - 1e-9))  # whole seconds, never 0
    unit = "requests per minute (RPM)" if kind == "requests" else "tokens per minute (TPM)"
    return APIError(429, f"Rate limit reached for tenant {tenant} on {unit}: Limit {limit}, Requested {requested}. "
                    f"Please try again in {wait}s.", kind, "rate_limited", code="rate_limit_exceeded",
                    headers={"Retry-After": str(wait), f"x-ratelimit-limit-{kind}": str(limit)})


class _Bucket:
    __slots__ = ("per_minute", "capacity", "level", "at")

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute, self.capacity, self.level, self.at = per_minute, float(per_minute), float(per_minute), now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.per_minute / 60.0)
            self.at = now

    def wait_s(self, amount: int) -> float:
        return max(0.0, (amount - self.level) * 60.0 / self.per_minute)


class Tenant:
    """One tenant's live state: its buckets and usage counters."""

    def __init__(self, config: TenantConfig, now: float) -> None:
        self.config = config
        self.name = config.name
        self.level = PRIORITY_CLASSES[config.priority]
        self._requests = _Bucket(config.requests_per_minute, now) if config.requests_per_minute else None
        self._tokens = _Bucket(config.tokens_per_minute, now) if config.tokens_per_minute else None
        self.counters: dict[str, float] = {"in_flight": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                           "rate_limited": 0}

    def stream_interval(self, server_default: int) -> int:
        """Tokens per streamed chunk for this tenant's requests: its own setting, else the server's."""
        return self.config.stream_interval or server_default

    def priority_for(self, requested: object = None) -> int:
        """The admission priority of a request of this tenant that asked for `requested` (None: the class's)."""
        if requested is None:
            return self.level
        if isinstance(requested, str) and requested in PRIORITY_CLASSES:
            value = PRIORITY_CLASSES[requested]
        elif is_int(requested):
            value = requested
        else:
            raise errors.invalid_request(f"priority must be one of {tuple(PRIORITY_CLASSES)} or an integer "
                                         f"(lower is earlier), got {requested!r}", param="priority")
        return min(max(value, self.level), LOWEST_PRIORITY)


class Grant:
    """A request's charge against its tenant's limits; settle() once when the request ends, on every path."""

    def __init__(self, tenant: Tenant, prompt_tokens: int, max_tokens: int, upfront_output_tokens: int) -> None:
        self.tenant, self.prompt_tokens, self.max_tokens = tenant, prompt_tokens, max_tokens
        self.output_charged = min(max_tokens, upfront_output_tokens)  # charged at admission
        self.settled = False

    def settle(self, completion_tokens: int, outcome: str = "ok", prompt_processed: bool = True) -> bool:
        """Correct the token charge to prompt + `completion_tokens`, more or less than was charged at admission
        (the prompt too is given back when it was never processed) and count the request under `outcome`. Only the
        first call acts; it returns True."""
        if not self._first_settle(completion_tokens, outcome):
            return False
        tenant = self.tenant
        if tenant._tokens is not None:
            refund = self.output_charged - completion_tokens + (0 if prompt_processed else self.prompt_tokens)
            tenant._tokens.level = min(tenant._tokens.capacity, tenant._tokens.level + refund)
        counters = tenant.counters
        counters["in_flight"] -= 1
        counters["prompt_tokens"] += self.prompt_tokens if prompt_processed else 0
        counters["completion_tokens"] += completion_tokens
        counters[f"requests_{outcome}"] = counters.get(f"requests_{outcome}", 0) + 1
        return True


    def _first_settle(self, completion_tokens: int, outcome: str) -> bool:
        """Check settle()'s arguments; True the first time (the grant is then settled), False after."""
        check_count("completion_tokens", completion_tokens)
        if not isinstance(outcome, str) or not _OUTCOME.fullmatch(outcome):
            raise ValueError(f"outcome must be a lowercase identifier, got {outcome!r}")
        if self.settled:
            return False
        self.settled = True
        return True


class TenantRegistry:
    def __init__(self, config: TenantsConfig | None = None, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 upfront_output_tokens: int = UPFRONT_OUTPUT_TOKENS) -> None:
        config = config or TenantsConfig()
        check_count("upfront_output_tokens", upfront_output_tokens)
        self.upfront_output_tokens = upfront_output_tokens
        if config.tenants and api_key is not None:
            raise ValueError("server.api_key and tenants are exclusive: with tenants configured, their api_keys "
                             "are the server's keys (move the key to a tenant)")
        self._clock, now = clock, clock()
        self.enabled = bool(config.tenants)
        self.tenants: dict[str, Tenant] = {c.name: Tenant(c, now) for c in config.tenants or (TenantConfig("default"),)}
        self._open = not self.enabled and api_key is None
        keys = [(key, tenant) for tenant in self.tenants.values() for key in tenant.config.api_keys]
        if api_key is not None:
            keys = [(api_key, self.tenants["default"])]
        self._keys = [(_digest(key), tenant) for key, tenant in keys]

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose key is in `Authorization: Bearer <key>`; raises the 401 APIError otherwise."""
        if self._open:
            return self.tenants["default"]
        scheme, _, token = (authorization or "").partition(" ")
        digest = _digest(token.strip())
        found = None
        for key_digest, tenant in self._keys:  # every key, no early exit
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        if scheme.lower() != "bearer" or found is None:
            raise errors.unauthorized()
        return found

    def admit(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Grant:
        """Charge one request's admission cost (prompt_tokens + min(max_tokens, upfront_output_tokens)) to
        `tenant`, or raise 429 (or 400 if it never fits); its Grant's settle() corrects it to what it used."""
        check_count("prompt_tokens", prompt_tokens)
        check_count("max_tokens", max_tokens)
        now = self._clock()
        output = min(max_tokens, self.upfront_output_tokens)
        cost = prompt_tokens + output
        requests, tokens = tenant._requests, tenant._tokens
        if tokens is not None and cost > tokens.capacity:
            tenant.counters["rate_limited"] += 1
            raise errors.invalid_request(
                f"This request needs {cost} tokens (prompt {prompt_tokens} + {output} of its output charged up "
                f"front), more than tenant {tenant.name}'s limit of {tenant.config.tokens_per_minute} tokens per "
                "minute; lower max_tokens or shorten the prompt", param="max_tokens", code="rate_limit_exceeded")
        for bucket, kind, amount in ((requests, "requests", 1), (tokens, "tokens", cost)):
            if bucket is not None:
                bucket.refill(now)
                if bucket.level < amount:
                    tenant.counters["rate_limited"] += 1
                    raise rate_limited(tenant.name, kind, bucket.per_minute, amount, bucket.wait_s(amount))
        for bucket, amount in ((requests, 1), (tokens, cost)):
            if bucket is not None:
                bucket.level -= amount
        tenant.counters["in_flight"] += 1
        return Grant(tenant, prompt_tokens, max_tokens, self.upfront_output_tokens)

    async def charge(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Grant:
        """admit(), as the HTTP layer calls it: an HTTP frontend process charges the core's buckets instead
        (coordinator.frontends.remote_tenants), so every process shares one set of limits."""
        return self.admit(tenant, prompt_tokens, max_tokens)

    def usage(self) -> dict[str, dict[str, float]]:
        """Per tenant: in_flight, prompt_tokens and completion_tokens (of ended requests), rate_limited (refused
        by its limits) and requests_<outcome> per outcome seen. A copy, for /metrics."""
        return {name: dict(tenant.counters) for name, tenant in self.tenants.items()}
