"""Decode pool: `DecodeWorker`, the Ray actor (one GPU, or CPUs) that pulls a prefilled request's KV through
kvtransfer and generates from its first token with continuous batching (or, in collocated mode, runs whole
requests). The coordinator's `Pools` creates, starts and stops these actors; its router picks one per request."""
