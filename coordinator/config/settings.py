"""ServerSettings: the HTTP coordinator's own settings (address, auth, limits, timeouts), validated once and frozen.

Owns only what the HTTP layer needs; the backend's settings (pools, workers, KV transfer) live with the backend.
Errors name the field, as `ServerSettings.<field> <why>, got <value>`.
"""

from __future__ import annotations

from dataclasses import dataclass

TOOL_CALL_PARSERS = ("llama3_json", "hermes")  # the chat-template families tool_choice "auto" can read
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # coordinator.api.reasoning (vLLM's --reasoning-parser names)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000                     # 0 = any free port (tests)
    api_key: str | None = None           # when set, /v1/* needs `Authorization: Bearer <api_key>`
    max_body_bytes: int = 4 << 20        # larger request bodies get 413
    # a request head (request line + headers) larger than this gets 431 (414: a request line alone) and the connection
    # closed, before any key is checked; a connection never holds more of a head (coordinator.api.http_protocol)
    max_request_header_bytes: int = 64 << 10
    request_timeout_s: float = 600.0     # a request still running after this ends (504, or an in-band error)
    drain_timeout_s: float = 30.0        # how long shutdown waits for in-flight requests
    served_model_name: str | None = None  # the model id clients send and /v1/models lists; None = backend.model_name
    admin_api: bool = False              # /admin/* (kill a worker, inject faults, roles, integrity): the operator's
    # the operator's own key: /admin/* (needed with admin_api) and /health's details (pids, hosts, failures) take
    # this key and no other; a tenant's key or server.api_key is a client's, never an operator's
    admin_api_key: str | None = None
    # a read-only key for monitoring: /metrics with it (or the operator's key) includes the tenant-labelled families
    # (tenants' names and usage); without either key /metrics shows everything else
    metrics_api_key: str | None = None
    keep_alive_timeout_s: float = 5.0    # an idle keep-alive connection is closed after this
    header_timeout_s: float = 10.0       # a connection must send a complete request head within this (else 408)
    body_read_timeout_s: float = 30.0    # the whole request body must arrive within this (else 408)
    # special-token text (e.g. "<|eot_id|>") inside chat message content becomes control tokens only when true
    allow_special_tokens_in_content: bool = False
    # how `tool_choice: auto` reads the model's tool calls: the chat-template family (TOOL_CALL_PARSERS)
    tool_call_parser: str = "llama3_json"
    # how chat responses keep a `<think>` model's reasoning apart (coordinator.api.reasoning); None: not at all
    reasoning_parser: str | None = None
    # a streamed response sends a chunk per this many new tokens (the first token and the end at once): larger
    # values trade smoothness for the coordinator's CPU per token (vLLM's and SGLang's --stream-interval)
    stream_interval: int = 1
    # HTTP processes: above 1, each serves connections (parsing, tokenization, detokenization, SSE) while one core
    # process keeps the workers, admission and tenants' limits (coordinator.frontends; vLLM's --api-server-count)
    api_processes: int = 1
    # above 0: log the event loop's stack whenever it stalls this many ms (coordinator.observability.stall_reporter),
    # in every process that serves; a diagnostic for latency tails, off by default
    stall_report_ms: float = 0.0
    # a streamed response whose client has taken none of its bytes for this long (bytes waiting for it, none
    # acknowledged) is cut: the request is aborted on every worker and its KV freed (coordinator.api.stall_watch)
    stall_timeout_s: float = 30.0
    # OpenTelemetry traces of requests (coordinator.observability.tracing), off while both are None: an OTLP/HTTP
    # collector's traces URL (vLLM's --otlp-traces-endpoint; e.g. http://collector:4318/v1/traces) and/or a file that
    # gets one JSON span per line; the share of requests traced (a client's sampled traceparent decides for its own)
    otlp_traces_endpoint: str | None = None
    traces_file: str | None = None
    trace_sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            ("host", isinstance(self.host, str) and bool(self.host), "must be a non-empty string"),
            ("port", _is_int(self.port) and 0 <= self.port <= 65535, "must be an integer in [0, 65535]"),
            ("api_key", _optional_str(self.api_key), "must be None or a non-empty string"),
            ("max_body_bytes", _is_int(self.max_body_bytes) and self.max_body_bytes > 0, "must be a positive integer"),
            ("max_request_header_bytes", _is_int(self.max_request_header_bytes)
             and 1024 <= self.max_request_header_bytes <= 64 << 20, "must be an integer in [1024, 67108864]"),
            ("request_timeout_s", _is_number(self.request_timeout_s) and self.request_timeout_s > 0,
             "must be a positive number"),
            ("drain_timeout_s", _is_number(self.drain_timeout_s) and self.drain_timeout_s >= 0,
             "must be a number >= 0"),
            ("served_model_name", _optional_str(self.served_model_name), "must be None or a non-empty string"),
            ("admin_api", isinstance(self.admin_api, bool), "must be true or false"),
            ("admin_api_key", _optional_str(self.admin_api_key) and (
                self.admin_api_key is None or (self.admin_api_key.split() == [self.admin_api_key]
                                               and self.admin_api_key != self.api_key)),
             "must be None or a non-empty string without whitespace, other than api_key"),
            ("metrics_api_key", _optional_str(self.metrics_api_key) and (
                self.metrics_api_key is None or (self.metrics_api_key.split() == [self.metrics_api_key]
                                                 and self.metrics_api_key not in (self.api_key, self.admin_api_key))),
             "must be None or a non-empty string without whitespace, other than api_key and admin_api_key"),
            *[(name, _is_number(getattr(self, name)) and 0 < getattr(self, name) <= 3600,
               "must be a number in (0, 3600]") for name in ("keep_alive_timeout_s", "header_timeout_s",
                                                            "body_read_timeout_s")],
            ("allow_special_tokens_in_content", isinstance(self.allow_special_tokens_in_content, bool),
             "must be true or false"),
            ("tool_call_parser", self.tool_call_parser in TOOL_CALL_PARSERS,
             f"must be one of {list(TOOL_CALL_PARSERS)}"),
            ("reasoning_parser", self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
             f"must be null or one of {list(REASONING_PARSERS)}"),
            ("stream_interval", _is_int(self.stream_interval) and 1 <= self.stream_interval <= 1024,
             "must be an integer in [1, 1024]"),
            ("api_processes", _is_int(self.api_processes) and 1 <= self.api_processes <= 64,
             "must be an integer in [1, 64]"),
            ("stall_report_ms", _is_number(self.stall_report_ms) and 0 <= self.stall_report_ms <= 60000,
             "must be a number in [0, 60000] (0: off)"),
            ("stall_timeout_s", _is_number(self.stall_timeout_s) and 0 < self.stall_timeout_s <= 3600,
             "must be a number in (0, 3600]"),
            ("otlp_traces_endpoint", self.otlp_traces_endpoint is None or (
                isinstance(self.otlp_traces_endpoint, str)
                and self.otlp_traces_endpoint.startswith(("http://", "https://"))),
             "must be None or an http:// or https:// URL"),
            ("traces_file", _optional_str(self.traces_file), "must be None or a file path"),
            ("trace_sample_ratio", _is_number(self.trace_sample_ratio) and 0 <= self.trace_sample_ratio <= 1,
             "must be a number in [0, 1]"),
        ]
        for name, ok, why in checks:
            if not ok:
                shown = "<hidden>" if name in ("admin_api_key", "metrics_api_key") else repr(getattr(self, name))
                raise ValueError(f"ServerSettings.{name} {why}, got {shown}")
        if self.admin_api and self.admin_api_key is None:
            raise ValueError("ServerSettings.admin_api needs admin_api_key: the operator's own key (without it, "
                             "anyone who reaches the port could kill workers)")


def tracing_on(settings: ServerSettings) -> bool:
    return settings.otlp_traces_endpoint is not None or settings.traces_file is not None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _optional_str(x: object) -> bool:
    return x is None or (isinstance(x, str) and bool(x))
