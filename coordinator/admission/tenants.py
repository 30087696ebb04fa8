"""Tenants: the `tenants:` config section, API-key authentication, per-tenant rate limits, priority and usage.

    tenants:                           # a list, or a mapping by name
      - {name: acme, api_keys: [sk-1, sk-2], requests_per_minute: 600, tokens_per_minute: 200000, priority: high}

Limits absent or null are unlimited; priority is high, normal (default) or low; `stream_interval` (tokens per
streamed chunk) overrides `server.stream_interval` for the tenant's requests (e.g. a bulk tenant's, so its flood
costs the coordinator less per token). With tenants configured their keys are the auth (no key, a malformed
header or an unknown key: 401; no anonymous tenant; `server.api_key` may not be set too). With none, all is as
before: one unlimited tenant "default" (normal), behind `server.api_key` when set.
A key's SHA-256 digest is compared (hmac.compare_digest) with every configured key's, with no early exit.

The requests limit is a token bucket, full at start and refilled continuously (per_minute / 60 per second, never
above per_minute) by the injected monotonic clock. The tokens limit is a sliding window (coordinator.admission
.token_window): the tokens charged to requests admitted within any minute sum to at most tokens_per_minute, so a
tenant's bursts are bounded too. A request reserves what it may use at admission and is charged what it used when it
settles (`Grant.settle(completion_tokens)`: the unused part comes back, the prompt too if it was never processed):
- with max_tokens (or a completion's default), prompt + max_tokens; more than tokens_per_minute: 400 at once;
- without (chat: the rest of the context), prompt + as much of its output as the window has room for, at least
  min(the rest of the context, MIN_OUTPUT_ALLOWANCE, the limit - prompt) and its min_tokens: its output is capped
  there (Grant.output_tokens: it ends with finish_reason "length" at that allowance, as at a max_tokens). Only a
  prompt that leaves no room for one output token under the limit is a 400.
A request is charged only if both limits hold its admission, else 429 in OpenAI's shape (type "requests" or
"tokens", code "rate_limit_exceeded") with Retry-After: the seconds until the refusing limit holds enough.
With a UsageLog (the server's state folder: coordinator.admission.tenant_usage_log) the token charges outlive a
coordinator restart; the requests buckets start full again.

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
from coordinator.admission.tenant_usage_log import UsageLog
from coordinator.admission.token_window import Charge, TokenWindow
from coordinator.config.tenants_config import LOWEST_PRIORITY, PRIORITY_CLASSES, TenantConfig, TenantsConfig, is_int
from coordinator.errors import APIError

_OUTCOME = re.compile(r"[a-z][a-z0-9_]*")
MIN_OUTPUT_ALLOWANCE = 256  # the least output a request without max_tokens is admitted with (if its context allows)


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
        self._tokens = TokenWindow(config.tokens_per_minute) if config.tokens_per_minute else None
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
    """A request's charge against its tenant's limits; settle() once when the request ends, on every path.
    `output_tokens`: the most output it may generate (its max_tokens, or less: the allowance of a request without
    max_tokens)."""

    def __init__(self, tenant: Tenant, prompt_tokens: int, output_tokens: int, registry: TenantRegistry | None = None,
                 charge: Charge | None = None, charge_id: int = 0) -> None:
        self.tenant, self.prompt_tokens, self.output_tokens = tenant, prompt_tokens, output_tokens
        self._registry, self._charge, self._charge_id = registry, charge, charge_id
        self.settled = False

    def settle(self, completion_tokens: int, outcome: str = "ok", prompt_processed: bool = True) -> bool:
        """Correct the token charge to what the request used (its prompt, unless it was never processed, and
        `completion_tokens`) and count the request under `outcome`. Only the first call acts; it returns True."""
        if not self._first_settle(completion_tokens, outcome):
            return False
        tenant = self.tenant
        if self._charge is not None and self._registry is not None:
            used = (self.prompt_tokens if prompt_processed else 0) + completion_tokens
            self._registry.correct(tenant, self._charge, self._charge_id, used)
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
                 min_output_allowance: int = MIN_OUTPUT_ALLOWANCE, usage_log: UsageLog | None = None) -> None:
        config = config or TenantsConfig()
        check_count("min_output_allowance", min_output_allowance)
        self.min_output_allowance = min_output_allowance
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
        self._log = usage_log
        if usage_log is not None:  # the charges a previous coordinator of this server made
            for name, charges in usage_log.load(now).items():
                window = self.tenants[name]._tokens if name in self.tenants else None
                if window is not None:
                    for charge in charges:
                        window.restore(charge)

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

    def admit(self, tenant: Tenant, prompt_tokens: int, max_tokens: int, max_tokens_given: bool = True,
              min_tokens: int = 0) -> Grant:
        """Reserve one request's tokens for `tenant` (the module's docstring: all of max_tokens when the request
        gave it, else an allowance), or raise 429 (or 400 if it can never fit); its Grant's settle() corrects the
        charge to what it used."""
        check_count("prompt_tokens", prompt_tokens)
        check_count("max_tokens", max_tokens)
        check_count("min_tokens", min_tokens)
        now = self._clock()
        requests, window = tenant._requests, tenant._tokens
        output, need = max_tokens, prompt_tokens + max_tokens
        if window is not None:
            output, need = self._reservation(tenant, window, now, prompt_tokens, max_tokens, max_tokens_given,
                                             min_tokens)
        if requests is not None:
            requests.refill(now)
            if requests.level < 1:
                tenant.counters["rate_limited"] += 1
                raise rate_limited(tenant.name, "requests", requests.per_minute, 1, requests.wait_s(1))
        if window is not None and window.room(now) < need:
            tenant.counters["rate_limited"] += 1
            raise rate_limited(tenant.name, "tokens", window.limit, need, window.wait_s(now, need))
        if requests is not None:
            requests.level -= 1
        charge, charge_id = None, 0
        if window is not None:
            charge = window.charge(now, prompt_tokens + output)
            if self._log is not None:
                charge_id = self._log.charged(tenant.name, charge, now)
        tenant.counters["in_flight"] += 1
        return Grant(tenant, prompt_tokens, output, self, charge, charge_id)

    def _reservation(self, tenant: Tenant, window: TokenWindow, now: float, prompt_tokens: int, max_tokens: int,
                     given: bool, min_tokens: int) -> tuple[int, int]:
        """(the output the request may generate, the tokens that must be free to admit it); 400 if never."""
        limit = window.limit
        if given:
            if prompt_tokens + max_tokens > limit:
                tenant.counters["rate_limited"] += 1
                raise errors.invalid_request(
                    f"This request needs {prompt_tokens + max_tokens} tokens (prompt {prompt_tokens} + max_tokens "
                    f"{max_tokens}), more than tenant {tenant.name}'s limit of {limit} tokens per minute; lower "
                    "max_tokens or shorten the prompt", param="max_tokens", code="rate_limit_exceeded")
            return max_tokens, prompt_tokens + max_tokens
        least = max(1, min_tokens, min(max_tokens, self.min_output_allowance, limit - prompt_tokens))
        if prompt_tokens + least > limit:
            tenant.counters["rate_limited"] += 1
            raise errors.invalid_request(
                f"This request's prompt ({prompt_tokens} tokens) leaves no room for {least} output tokens under "
                f"tenant {tenant.name}'s limit of {limit} tokens per minute; shorten the prompt",
                param="max_tokens", code="rate_limit_exceeded")
        room = window.room(now) - prompt_tokens
        return max(least, min(max_tokens, room)), prompt_tokens + least

    def correct(self, tenant: Tenant, charge: Charge, charge_id: int, used: int) -> None:
        """A settled request's charge set to what it used (Grant.settle)."""
        if tenant._tokens is None:
            return
        now = self._clock()
        tenant._tokens.correct(charge, used, now)
        if self._log is not None and charge_id:
            self._log.corrected(charge_id, charge, now)

    async def charge(self, tenant: Tenant, prompt_tokens: int, max_tokens: int, max_tokens_given: bool = True,
                     min_tokens: int = 0) -> Grant:
        """admit(), as the HTTP layer calls it: an HTTP frontend process charges the core's limits instead
        (coordinator.frontends.remote_tenants), so every process shares one set of limits."""
        return self.admit(tenant, prompt_tokens, max_tokens, max_tokens_given, min_tokens)

    def usage(self) -> dict[str, dict[str, float]]:
        """Per tenant: in_flight, prompt_tokens and completion_tokens (of ended requests), rate_limited (refused
        by its limits) and requests_<outcome> per outcome seen. A copy, for /metrics."""
        return {name: dict(tenant.counters) for name, tenant in self.tenants.items()}
