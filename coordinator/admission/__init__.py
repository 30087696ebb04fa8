"""Who may run, and when and where: tenants' keys, limits and priorities (tenants), the priority waiting room
(admission_queue), the books of what every request holds (reservation: Reservation and Ledger), and Admission,
which places a request on workers and books its KV and prompt tokens there, or says why it must wait.

May import: contract, errors, observability, config. Workers are read through what the caller passes (their
states, a router); the Ray backend above owns them."""
