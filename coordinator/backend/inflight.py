"""InFlight: the coordinator's record of one single-choice request while it runs, for GET /admin/requests/{id}.

RayBackend.generate opens one per request id (the id on the workers) and drops it when the request ends; the
request's task is its only writer (state, placement, moves, output tokens), and `view()` only reads it, so an
operator's look changes nothing. What a view holds:
- `state`: `queued` (waiting for admission: coordinator.admission), `prefill` (its prompt being computed; on a
  prefill worker when `placement` is `remote`), `decode` (its first token out, decoding), `migrating` (its worker was
  lost; it waits to be placed again);
- `placement`: `remote` (prefilled on a prefill worker, its KV handed to the decode worker) or `local` (the decode
  worker computes the prompt too: collocated or adaptive), with `prefill_worker` and `decode_worker` by name;
- `kv_blocks`: `booked`, the blocks admission booked for it per worker (coordinator.admission.reservation), and
  `used`, the blocks its tokens fill now (prompt + output over the block size: what the decode worker holds for it,
  a shared prefix included);
- `phases`: seconds per phase so far (coordinator.observability.phases, the open interval as overhead), `age_s`;
- `migrations` (times it was moved), `prompt_tokens`, `output_tokens`, `max_tokens`, `priority`.
Requests with several choices (n > 1) run as groups (coordinator.backend.ray_group) and are not recorded here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from coordinator.admission.reservation import Reservation
from coordinator.observability.phases import PhaseTrace, wire


@dataclass
class InFlight:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    priority: int
    block_size: int
    trace: PhaseTrace
    reservation: Reservation
    started: float  # time.monotonic() when the backend got it
    state: str = "queued"
    prefill_worker: str | None = None
    decode_worker: str | None = None
    moves: int = 0
    output_tokens: int = 0

    def placed(self, prefill: Any, decode: Any) -> None:
        self.prefill_worker = None if prefill is None else prefill.name
        self.decode_worker = decode.name
        self.state = "prefill"

    def view(self, names: dict[str, str]) -> dict[str, Any]:
        """The JSON view; `names`: worker ledger key -> worker name (a replaced worker's key shows as its key)."""
        booked: dict[str, dict[str, int]] = {}
        for (key, kind), amount in list(self.reservation.bookings.items()):
            booked.setdefault(names.get(key, key), {})[kind] = amount
        tokens = self.prompt_tokens + self.output_tokens
        return {
            "id": self.request_id, "state": self.state,
            "placement": None if self.decode_worker is None else ("local" if self.prefill_worker is None
                                                                  else "remote"),
            "prefill_worker": self.prefill_worker, "decode_worker": self.decode_worker,
            "kv_blocks": {"booked": booked, "used": -(-tokens // self.block_size) if self.state == "decode" else 0},
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens, "max_tokens": self.max_tokens,
            "priority": self.priority, "migrations": self.moves, "age_s": round(time.monotonic() - self.started, 6),
            "phases": wire(self.trace.snapshot()),
        }
