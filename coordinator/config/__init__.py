"""The serving configuration: the YAML loaded once into one validated, frozen tree (serve_config), the HTTP
server's own settings (settings) and the tenants section (tenants_config). A bad key or value is a ConfigError
naming the file, the key and the reason.

May import: nothing of the coordinator (the engine's config types and ConfigError only)."""
