"""The HTTP edge: the OpenAI and vLLM request bodies parsed once into a GenerateRequest (protocol, sampling_fields,
structured_outputs, tool_calls), the in-flight count and drain (drain), a request's life from its first backend
call to its end (lifecycle), and the responses shaped from internal outputs (sse, text_output, choices,
choices_serve, single_serve, tool_stream), streams whose client stopped reading (stall_watch); the model's routes
(model_api), operators' routes (admin), the app (app: the stages; internal_request: the parse stage) and the HTTP
server (http_server, http_protocol, http_body) and its listening socket (listener).

May import: admission (tenants), contract, errors, observability, config. Never backend: it serves any
ServingBackend (tests run it over an in-process engine)."""
