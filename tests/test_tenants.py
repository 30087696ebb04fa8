"""Tenants: the YAML section and its errors, API-key authentication, token-bucket limits driven by a fake clock
(429 bodies and Retry-After exact), settling a grant exactly once, usage counters and request priorities."""

from __future__ import annotations

import pytest
import yaml

from coordinator.admission.tenants import TenantRegistry
from coordinator.config.tenants_config import PRIORITY_CLASSES, TenantConfig, TenantsConfig, parse_tenants
from coordinator.errors import APIError
from engine.config_error import ConfigError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


YAML = """
tenants:
  - name: acme
    api_keys: [sk-acme-1, sk-acme-2]
    requests_per_minute: 3
    tokens_per_minute: 1200
    priority: high
  - name: batch
    api_keys: sk-batch
    priority: low
"""


def registry(clock: FakeClock, upfront: int = 500, **acme) -> TenantRegistry:
    """`upfront`: output tokens charged at admission (500 here, so a request's whole max_tokens up to it)."""
    acme_config = TenantConfig("acme", ("sk-acme",), **acme)
    return TenantRegistry(TenantsConfig((acme_config, TenantConfig("other", ("sk-other",)))), clock=clock,
                          upfront_output_tokens=upfront)


def test_list_and_mapping_forms_parse_to_the_same_config(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(YAML)
    from_list = parse_tenants(yaml.safe_load(path.read_text())["tenants"], path)
    mapping = {"acme": {"api_keys": ["sk-acme-1", "sk-acme-2"], "requests_per_minute": 3, "tokens_per_minute": 1200,
                        "priority": "high"}, "batch": {"api_keys": ["sk-batch"], "priority": "low"}}
    assert parse_tenants(mapping) == from_list
    assert from_list == TenantsConfig((
        TenantConfig("acme", ("sk-acme-1", "sk-acme-2"), 3, 1200, "high"),
        TenantConfig("batch", ("sk-batch",), None, None, "low")))
    assert parse_tenants(None) == TenantsConfig() and TenantConfig("x", ("k",)).priority == "normal"


@pytest.mark.parametrize("raw, message", [
    ({"acme": {"api_keys": ["sk-1"], "requests_per_minute": 0}},
     "cfg.yaml: tenants.acme: TenantConfig.requests_per_minute must be a positive integer or None, got 0"),
    ({"acme": {"api_keys": ["sk-1"], "tokens_per_minute": True}},
     "cfg.yaml: tenants.acme: TenantConfig.tokens_per_minute must be a positive integer or None, got True"),
    ([{"name": "acme", "api_keys": ["sk-1"], "rpm": 5}], "cfg.yaml: unknown key 'tenants.acme.rpm'"),
    ([{"name": "acme", "api_keys": ["sk-1"], "priority": "urgent"}],
     "cfg.yaml: tenants.acme: TenantConfig.priority must be one of ('high', 'normal', 'low'), got 'urgent'"),
    ([{"api_keys": ["sk-1"]}], "cfg.yaml: tenants[0]: every tenant needs a name"),
    ([{"name": "a b", "api_keys": ["sk-1"]}], "cfg.yaml: tenants.a b: TenantConfig.name must be letters"),
    ([{"name": "acme\n", "api_keys": ["sk-1"]}], "TenantConfig.name must be letters"),
    ({"acme": {"api_keys": ["sk- has space"]}},
     "cfg.yaml: tenants.acme: TenantConfig.api_keys must be distinct non-empty strings without whitespace, "
     "got <hidden>"),
    ({"acme": {"api_keys": ["sk-1", "sk-1"]}}, "TenantConfig.api_keys must be distinct"),
    ({"acme": {}}, "cfg.yaml: tenants: TenantsConfig.tenants: tenant 'acme' needs at least one key in api_keys"),
    ({"a": {"api_keys": ["sk-1", "sk-shared"]}, "b": {"api_keys": ["sk-shared"]}},
     "cfg.yaml: tenants: TenantsConfig.tenants: tenants 'a' and 'b' share an API key; keys must be unique"),
    ([{"name": "a", "api_keys": ["sk-1"]}, {"name": "a", "api_keys": ["sk-2"]}], "the name 'a' is used twice"),
    ({"acme": ["sk-1"]}, "cfg.yaml: tenants.acme must be a mapping of keys"),
    ("acme", "cfg.yaml: 'tenants' must be a list or a mapping of tenants"),
])
def test_bad_sections_name_the_file_tenant_and_key(raw, message) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tenants(raw, "cfg.yaml")
    assert message in str(info.value)
    assert "sk-" not in str(info.value)  # never a key in an error


def auth_error(reg: TenantRegistry, header: str | None) -> APIError:
    with pytest.raises(APIError) as info:
        reg.authenticate(header)
    return info.value


def test_keys_are_the_auth_when_tenants_are_configured() -> None:
    reg = TenantRegistry(parse_tenants(yaml.safe_load(YAML)["tenants"]))
    assert reg.enabled and sorted(reg.tenants) == ["acme", "batch"]
    assert reg.authenticate("Bearer sk-acme-1").name == "acme"
    assert reg.authenticate("bearer  sk-acme-2 ").name == "acme"
    assert reg.authenticate("Bearer sk-batch") is reg.tenants["batch"]
    for header in (None, "", "Bearer", "Bearer ", "Bearer sk-acme", "Basic sk-acme-1", "sk-acme-1",
                   "Bearer sk-acme-1x"):
        err = auth_error(reg, header)
        assert (err.status, err.type, err.code, err.kind) == (401, "authentication_error", "invalid_api_key", "auth")
        assert err.headers == {"WWW-Authenticate": "Bearer"}


def test_without_tenants_one_unlimited_default_tenant_open_or_behind_server_api_key() -> None:
    open_reg = TenantRegistry()
    assert not open_reg.enabled
    for header in (None, "Bearer anything", "junk"):
        assert open_reg.authenticate(header).name == "default"
    keyed = TenantRegistry(TenantsConfig(), api_key="secret key")  # ServerSettings allows any non-empty string
    assert keyed.authenticate("Bearer secret key") is keyed.tenants["default"]
    assert auth_error(keyed, None).status == 401 and auth_error(keyed, "Bearer secret").status == 401
    default = keyed.tenants["default"]
    for _ in range(1000):
        keyed.admit(default, 10**6, 10**6)  # no limits
    assert keyed.usage()["default"]["in_flight"] == 1000 and default.priority_for() == PRIORITY_CLASSES["normal"]
    with pytest.raises(ValueError, match="server.api_key and tenants are exclusive"):
        TenantRegistry(TenantsConfig((TenantConfig("a", ("k",)),)), api_key="k2")


def rate_error(reg: TenantRegistry, tenant, prompt: int, max_tokens: int) -> APIError:
    with pytest.raises(APIError) as info:
        reg.admit(tenant, prompt, max_tokens)
    return info.value


def test_requests_per_minute_bucket_refills_continuously_and_says_when() -> None:
    clock = FakeClock()
    reg = registry(clock, requests_per_minute=3)
    acme = reg.tenants["acme"]
    for _ in range(3):
        reg.admit(acme, 5, 5)
    err = rate_error(reg, acme, 5, 5)
    assert err.status == 429 and err.headers["Retry-After"] == "20" and err.headers["x-ratelimit-limit-requests"] == "3"
    assert err.body() == {"error": {
        "message": "Rate limit reached for tenant acme on requests per minute (RPM): Limit 3, Requested 1. "
                   "Please try again in 20s.", "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    clock.now += 10                      # half a request back
    assert rate_error(reg, acme, 5, 5).headers["Retry-After"] == "10"
    clock.now += 10
    reg.admit(acme, 5, 5)
    clock.now += 3600                    # a full bucket, never more than its capacity
    for _ in range(3):
        reg.admit(acme, 5, 5)
    assert rate_error(reg, acme, 5, 5).status == 429
    reg.admit(reg.tenants["other"], 5, 5)  # another tenant's bucket is its own
    assert reg.usage()["acme"]["rate_limited"] == 3 and reg.usage()["other"]["rate_limited"] == 0


def test_tokens_per_minute_reserves_max_tokens_and_settle_corrects_to_actual_once() -> None:
    clock = FakeClock()
    reg = registry(clock, tokens_per_minute=1200)  # 20 tokens per second
    acme = reg.tenants["acme"]
    first = reg.admit(acme, 100, 500)
    second = reg.admit(acme, 100, 500)       # the bucket is empty now
    err = rate_error(reg, acme, 100, 100)
    assert (err.status, err.type, err.code) == (429, "tokens", "rate_limit_exceeded")
    assert err.headers["Retry-After"] == "10" and err.headers["x-ratelimit-limit-tokens"] == "1200"
    assert first.settle(100) is True          # 400 unused max_tokens come back
    assert first.settle(100) is False and first.settle(0, "error") is False  # exactly once
    reg.admit(acme, 100, 300)
    assert rate_error(reg, acme, 0, 1).headers["Retry-After"] == "1"
    assert second.settle(0, "overloaded", prompt_processed=False) is True  # never ran: prompt back too
    reg.admit(acme, 200, 400)
    assert rate_error(reg, acme, 0, 1).status == 429
    too_big = rate_error(reg, acme, 1000, 201)
    assert (too_big.status, too_big.param, too_big.code) == (400, "max_tokens", "rate_limit_exceeded")
    assert "needs 1201 tokens (prompt 1000 + 201 of its output charged up front)" in too_big.message
    assert reg.usage()["acme"] == {"in_flight": 2, "prompt_tokens": 100, "completion_tokens": 100,
                                   "rate_limited": 4, "requests_ok": 1, "requests_overloaded": 1}


def test_tokens_per_minute_charges_what_was_used_not_the_context_window() -> None:
    # issue 38: a chat request without max_tokens gets the rest of the context (here 131,000 tokens), far above
    # the tenant's limit; it is charged its prompt and the first 256 outputs, then what it generated
    clock = FakeClock()
    reg = registry(clock, upfront=256, tokens_per_minute=6000)  # 100 tokens per second
    acme = reg.tenants["acme"]
    grant = reg.admit(acme, 100, 131_000)  # was a 400: "needs 131100 tokens"
    assert grant.output_charged == 256
    assert grant.settle(40) is True  # used 140 tokens: 216 come back
    grants = [reg.admit(acme, 100, 131_000) for _ in range(16)]  # 16 x 356 of the 5,860 left
    assert rate_error(reg, acme, 100, 131_000).status == 429
    assert grants[0].settle(3000) is True  # generated 2,744 beyond its charge: the bucket goes 2,580 below zero
    err = rate_error(reg, acme, 0, 1)
    assert err.status == 429 and err.headers["Retry-After"] == "26"  # until the refill has paid the debt
    clock.now += 26
    reg.admit(acme, 0, 1)
    assert rate_error(reg, acme, 5800, 1001).status == 400  # a prompt too long for the limit still is one
    assert reg.usage()["acme"]["completion_tokens"] == 3040


def test_a_request_refused_by_one_bucket_is_not_charged_to_the_other() -> None:
    clock = FakeClock()
    reg = registry(clock, requests_per_minute=2, tokens_per_minute=120)
    acme = reg.tenants["acme"]
    reg.admit(acme, 100, 0)
    assert rate_error(reg, acme, 50, 0).type == "tokens"
    reg.admit(acme, 20, 0)                    # the refused one took no request from the bucket
    assert rate_error(reg, acme, 0, 0).type == "requests"


def test_usage_counts_every_outcome_per_tenant() -> None:
    reg = registry(FakeClock())
    acme, other = reg.tenants["acme"], reg.tenants["other"]
    grants = [reg.admit(acme, 10, 50), reg.admit(acme, 20, 50), reg.admit(acme, 30, 50), reg.admit(other, 7, 8)]
    grants[0].settle(50)
    grants[1].settle(12, "cancelled")
    grants[2].settle(0, "error", prompt_processed=False)
    assert reg.usage() == {
        "acme": {"in_flight": 0, "prompt_tokens": 30, "completion_tokens": 62, "rate_limited": 0, "requests_ok": 1,
                 "requests_cancelled": 1, "requests_error": 1},
        "other": {"in_flight": 1, "prompt_tokens": 0, "completion_tokens": 0, "rate_limited": 0}}
    snapshot = reg.usage()
    snapshot["acme"]["in_flight"] = 99
    assert reg.usage()["acme"]["in_flight"] == 0  # a copy
    for bad in ((-1,), (1.5,), (1, "Bad Outcome"), (1, "ok\n")):
        with pytest.raises(ValueError):
            grants[3].settle(*bad)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0"):
        reg.admit(acme, 1, -1)


def test_a_request_may_lower_its_priority_but_never_raise_it_above_its_tenant_class() -> None:
    reg = TenantRegistry(parse_tenants(yaml.safe_load(YAML)["tenants"]))
    acme, batch = reg.tenants["acme"], reg.tenants["batch"]
    assert [acme.priority_for(p) for p in (None, "high", "normal", "low", 0, -5, 2, 3, 99)] == [1, 1, 2, 3, 1, 1, 2,
                                                                                               3, 3]
    assert [batch.priority_for(p) for p in (None, "high", 0, "low")] == [3, 3, 3, 3]
    for bad in ("urgent", True, 1.5, [1], ""):
        with pytest.raises(APIError) as info:
            acme.priority_for(bad)
        assert (info.value.status, info.value.param) == (400, "priority")
