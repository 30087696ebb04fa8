"""TokenWindow: one tenant's tokens-per-minute limit as a sliding window of charges (coordinator.admission.tenants).

Each admitted request adds one charge (its reservation) at its admission time; settling corrects that charge to
what the request used. A charge counts against the limit for WINDOW_S seconds after its admission, so the charges
admitted in any WINDOW_S-long window sum to at most the limit: no burst above it, unlike a token bucket (which
allows a full bucket plus its refill, twice the limit, within one minute). The running total is kept, so admission
is O(1) amortised. Times are the registry's clock (monotonic seconds). Not thread-safe: the event loop's only.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 60.0


class Charge:
    """One request's place in its tenant's window: when it was admitted and how many tokens it counts."""

    __slots__ = ("at", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.at, self.tokens = at, tokens


class TokenWindow:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._charges: deque[Charge] = deque()
        self._total = 0

    def used(self, now: float) -> int:
        """Tokens charged within the last WINDOW_S seconds."""
        while self._charges and self._charges[0].at <= now - WINDOW_S:
            self._total -= self._charges.popleft().tokens
        return self._total

    def room(self, now: float) -> int:
        return self.limit - self.used(now)

    def charge(self, now: float, tokens: int) -> Charge:
        self.used(now)
        charge = Charge(now, tokens)
        self._charges.append(charge)
        self._total += tokens
        return charge

    def restore(self, charge: Charge) -> None:
        """Take back a charge a previous coordinator made (oldest first: coordinator.admission.tenant_usage_log)."""
        self._charges.append(charge)
        self._total += charge.tokens

    def correct(self, charge: Charge, tokens: int, now: float) -> None:
        """Set `charge` to `tokens` (what its request used), if it still counts (within the window)."""
        if charge.at > now - WINDOW_S:
            self.used(now)
            self._total += tokens - charge.tokens
        charge.tokens = tokens

    def wait_s(self, now: float, tokens: int) -> float:
        """Seconds until `tokens` fit, as the charges now in the window expire (0 if they fit now)."""
        free = self.room(now)
        if free >= tokens:
            return 0.0
        for charge in self._charges:
            free += charge.tokens
            if free >= tokens:
                return charge.at + WINDOW_S - now
        return WINDOW_S  # more than the limit: never (admission refuses those with a 400 first)
