"""Choosing tokens from logits: the sampler, logits processing (penalties, bias) and grammar masks."""
