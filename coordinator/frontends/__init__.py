"""HTTP frontends: `server.api_processes` > 1 serves HTTP from several processes in front of one core process that
keeps the workers (core_process, core_service), over one Link each (link, wire); a frontend's backend is the core
(core_client) and its tenants' limits are the core's (remote_tenants); processes starts and restarts them.

May import: api, admission, contract, errors, observability, config (never backend: the core hands it in)."""
