"""UsageLog: the tenants' token charges kept across a coordinator restart, in a file of the server's state folder.

`pdserve serve`'s supervisor (coordinator.process_supervisor) gives every coordinator it starts the same private
state folder; the coordinator's TenantRegistry appends each charge (admission) and each correction (settle) to
USAGE_LOG there as one line, written with one unbuffered append, so what a coordinator killed at any moment had
charged is on disk. The next coordinator reads back the charges still inside the window (coordinator.admission
.token_window) and admits against them: a restart does not wipe the tenants' usage. A request cut by the crash
stays charged what it had reserved (its real use died with the coordinator). The file is rewritten with only the
live charges when it is read and every COMPACT_EVERY lines.

Lines: `a ID AT TENANT TOKENS` (a charge admitted at AT, monotonic seconds: one clock for every process of the
host) and `c ID TOKENS` (its correction). A line cut short by a crash is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

from coordinator.admission.token_window import WINDOW_S, Charge

USAGE_LOG = "tenant-usage.log"
COMPACT_EVERY = 20000


class UsageLog:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._live: dict[int, tuple[str, Charge]] = {}
        self._next_id = 1
        self._lines = 0
        self._fd = -1

    def load(self, now: float) -> dict[str, list[Charge]]:
        """The charges of the last WINDOW_S seconds per tenant, oldest first (then the file holds only them)."""
        found: dict[int, tuple[str, Charge]] = {}
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            parts = line.split()
            try:
                if parts[0] == "a" and len(parts) == 5:
                    found[int(parts[1])] = (parts[3], Charge(float(parts[2]), int(parts[4])))
                elif parts[0] == "c" and len(parts) == 3 and int(parts[1]) in found:
                    found[int(parts[1])][1].tokens = int(parts[2])
            except (IndexError, ValueError):
                continue  # a line cut short
        self._next_id = max(found, default=0) + 1
        self._live = {i: (t, c) for i, (t, c) in found.items() if c.at > now - WINDOW_S}
        self._rewrite(now)
        by_tenant: dict[str, list[Charge]] = {}
        for _, (tenant, charge) in sorted(self._live.items(), key=lambda item: item[1][1].at):
            by_tenant.setdefault(tenant, []).append(charge)
        return by_tenant

    def charged(self, tenant: str, charge: Charge, now: float) -> int:
        """Record a new charge; its id (for corrected())."""
        cid, self._next_id = self._next_id, self._next_id + 1
        self._live[cid] = (tenant, charge)
        self._append(f"a {cid} {charge.at!r} {tenant} {charge.tokens}\n", now)
        return cid

    def corrected(self, cid: int, charge: Charge, now: float) -> None:
        self._append(f"c {cid} {charge.tokens}\n", now)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _append(self, line: str, now: float) -> None:
        if self._fd < 0:
            self._rewrite(now)
        os.write(self._fd, line.encode())
        self._lines += 1
        if self._lines >= COMPACT_EVERY:
            self._rewrite(now)

    def _rewrite(self, now: float) -> None:
        """Replace the file with the live charges' lines (atomically: a crash leaves the old file or the new)."""
        self._live = {i: (t, c) for i, (t, c) in self._live.items() if c.at > now - WINDOW_S}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"a {i} {c.at!r} {t} {c.tokens}\n" for i, (t, c) in self._live.items()),
                       encoding="utf-8")
        os.replace(tmp, self.path)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._lines = len(self._live)
