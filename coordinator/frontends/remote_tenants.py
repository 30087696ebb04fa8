"""RemoteTenants: an HTTP frontend process's tenants, whose rate-limit buckets and usage live in the core process.

Authentication, a tenant's priority class and stream interval are read from the (frozen) config in each frontend;
charging a request (`charge`, a 429 past a limit) and settling it go to the core (CoreService's `tenant_admit` /
`tenant_settle`), so every frontend draws on one set of buckets and the limits hold however connections spread over
the processes. `usage()` is the core's, as of the last /metrics refresh.
"""

from __future__ import annotations

from coordinator import errors
from coordinator.admission.tenants import Grant, Tenant, TenantRegistry, check_count
from coordinator.config.tenants_config import TenantsConfig
from coordinator.contract import BackendError
from coordinator.frontends.core_client import CoreBackend


class RemoteGrant(Grant):
    def __init__(self, core: CoreBackend, grant_id: int, tenant: Tenant, prompt_tokens: int,
                 output_tokens: int) -> None:
        super().__init__(tenant, prompt_tokens, output_tokens)  # the core's own Grant does the accounting
        self._core, self._id = core, grant_id

    def settle(self, completion_tokens: int, outcome: str = "ok", prompt_processed: bool = True) -> bool:
        if not self._first_settle(completion_tokens, outcome):
            return False
        self._core.notify("tenant_settle", self._id, completion_tokens, outcome, prompt_processed)
        return True


class RemoteTenants(TenantRegistry):
    def __init__(self, config: TenantsConfig, api_key: str | None, core: CoreBackend) -> None:
        super().__init__(config, api_key)
        self._core = core

    async def charge(self, tenant: Tenant, prompt_tokens: int, max_tokens: int, max_tokens_given: bool = True,
                     min_tokens: int = 0) -> Grant:
        check_count("prompt_tokens", prompt_tokens)
        check_count("max_tokens", max_tokens)
        check_count("min_tokens", min_tokens)
        try:
            grant_id, output_tokens = await self._core.call("tenant_admit", tenant.name, prompt_tokens, max_tokens,
                                                            max_tokens_given, min_tokens)
        except BackendError as e:  # the core is gone (this process exits next): a 503, not a 500
            raise errors.unavailable(f"The server is not available: {e}", 1.0, "unavailable") from None
        return RemoteGrant(self._core, grant_id, tenant, prompt_tokens, output_tokens)

    def usage(self) -> dict[str, dict[str, float]]:
        return self._core.tenant_usage()
