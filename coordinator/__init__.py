"""Coordinator (to come): the OpenAI-compatible HTTP/SSE endpoint, tokenization, admission, routing of each request
to one prefill and one decode actor, and the request life cycle (stream, cancel, timeout). It never touches tensors."""
