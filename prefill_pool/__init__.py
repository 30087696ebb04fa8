"""Prefill pool: `PrefillWorker`, the Ray actor (one GPU, or CPUs) that runs prompts on an engine in prefill-only
mode and keeps each prompt's KV blocks pinned until the decode worker has pulled them. The coordinator's
`Pools` creates, starts and stops these actors; its router picks one per request."""
