"""Coordinator: the OpenAI-compatible HTTP/SSE endpoint (`app`), tokenization, admission, routing (`router`) of
each request to one prefill and one decode actor (`ray_backend`, `pools`), the request life cycle, the YAML
config (`serve_config`) and the `pdserve` command (`cli`, `serve`). It never touches tensors."""
