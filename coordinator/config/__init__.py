"""The serving configuration: the YAML loaded once into one validated, frozen tree (loaded by serve_config, its top
level in config_tree), one module per section (pool_config, transfer_config, admission_config, recovery_config,
faults_config, straggler_config, scaling_config, adaptive_config; the HTTP server's own settings, settings; the
tenants, tenants_config) and the checks across sections (config_checks). A bad key or value is a ConfigError naming
the file, the key and the reason.

May import: nothing of the coordinator (the engine's config types and ConfigError only)."""
