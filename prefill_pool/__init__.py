"""Prefill pool (to come): Ray actors, one GPU each, that run prompts on an engine in prefill-only mode,
keep the prompt's KV blocks pinned until the decode side has them, and a pool that starts, watches and picks them."""
