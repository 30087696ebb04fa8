"""Decode pool (to come): Ray actors, one GPU each, that accept prefilled requests (prompt KV moved in by
kvtransfer, plus the first token) and generate with continuous batching; a pool that starts, watches and
picks them."""
