"""RequestTracer: OpenTelemetry traces of requests, off by default (`server.otlp_traces_endpoint`, vLLM's name for
the same setting, and/or `server.traces_file`).

One trace per traced request (the single-choice requests that have phases: coordinator.observability.phases): a
root span `pdserve.request` (kind SERVER) from its arrival to its end, a child of the client's W3C `traceparent`
when the request carried one, and under it one span per phase interval, named by its phase, in order. The
intervals partition the request's time exactly as its phases do, so a phase's spans sum to what
`pdserve_request_phase_seconds{phase}` observed for it. Worker-measured phases (prefill_queue, prefill_compute,
kv_transfer, decode_join, first_decode_step) come from the durations the workers report, placed on the
coordinator's clock (only durations cross machines), so the process that ends the request exports its whole trace
and no worker needs an exporter; the root span names the workers that ran it (`pdserve.prefill_worker`,
`pdserve.decode_worker`) and its placement.

Owns its own TracerProvider (never the process-global one), a batch span processor and the exporters: OTLP over
HTTP (protobuf; the optional package opentelemetry-exporter-otlp-proto-http, `pip install "pdserve[tracing]"`) and
a JSON-lines file (one span per line, for a machine without a collector). The OpenTelemetry packages are imported
only when tracing is on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from coordinator.observability.phases import PhaseTrace

log = logging.getLogger("pdserve")
EXPORT_DELAY_MS = 1000  # the batch processor sends what it holds at least this often


class RequestTracer:
    def __init__(self, otlp_endpoint: str | None, traces_file: str | None, sample_ratio: float = 1.0,
                 service_name: str = "pdserve") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        for exporter in _exporters(otlp_endpoint, traces_file):
            self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()

    def record(self, trace: PhaseTrace, traceparent: str | None, attributes: dict[str, Any]) -> None:
        """Export a finished request's spans: the root and one per phase interval (see the module)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        intervals = trace.intervals()
        if not intervals:
            return
        to_ns = _wall_clock()
        parent = self._propagator.extract({"traceparent": traceparent}) if traceparent else None
        root = self._tracer.start_span("pdserve.request", context=parent, kind=SpanKind.SERVER,
                                       start_time=to_ns(trace.start),
                                       attributes={**attributes, **trace.attributes})
        inside = set_span_in_context(root)
        for phase, start, end in intervals:
            span = self._tracer.start_span(phase, context=inside, start_time=to_ns(start),
                                           attributes={"pdserve.phase": phase})
            span.end(end_time=to_ns(end))
        root.end(end_time=to_ns(intervals[-1][2]))

    def shutdown(self) -> None:
        """Send what is held and stop the exporters."""
        self._provider.shutdown()


class RequestSpan:
    """One request's tracing: the tracer and the client's traceparent, until the request ends
    (coordinator.api.lifecycle.Generation.close calls `end`)."""

    def __init__(self, tracer: RequestTracer, traceparent: str | None, model: str) -> None:
        self._tracer, self._traceparent, self._model = tracer, traceparent, model

    def end(self, trace: PhaseTrace, request_id: str, outcome: str, prompt_tokens: int, completion_tokens: int,
            max_tokens: int, finish_reason: str | None) -> None:
        attributes: dict[str, Any] = {
            "pdserve.request_id": request_id, "pdserve.outcome": outcome, "gen_ai.request.model": self._model,
            "gen_ai.request.max_tokens": max_tokens, "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": completion_tokens}
        if finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [finish_reason]
        try:
            self._tracer.record(trace, self._traceparent, attributes)
        except Exception:  # noqa: BLE001 - a broken exporter or a malformed traceparent never fails a request
            log.exception("request %s: its trace could not be recorded", request_id)


def _wall_clock():
    """A converter from time.monotonic() seconds to Unix nanoseconds, as of now."""
    mono, wall = time.monotonic(), time.time_ns()
    return lambda t: wall - int((mono - t) * 1e9)


def _exporters(otlp_endpoint: str | None, traces_file: str | None) -> list[Any]:
    out: list[Any] = []
    if otlp_endpoint is not None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError("ServerSettings.otlp_traces_endpoint needs the package "
                             "opentelemetry-exporter-otlp-proto-http (pip install \"pdserve[tracing]\")") from None
        out.append(OTLPSpanExporter(endpoint=otlp_endpoint))
    if traces_file is not None:
        out.append(JsonLinesExporter(traces_file))
    return out


class JsonLinesExporter:
    """A span exporter (the SDK's SpanExporter protocol) that appends one JSON object per span to a file. Each
    batch is one write() to a file opened O_APPEND, so the HTTP processes (server.api_processes) that share the file
    never interleave inside a line."""

    def __init__(self, path: str) -> None:
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(json.dumps(_span_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _span_dict(span: Any) -> dict[str, Any]:
    ctx, parent = span.context, span.parent
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
            "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None, "name": span.name,
            "start_unix_nano": span.start_time, "end_unix_nano": span.end_time,
            "attributes": dict(span.attributes or {})}
