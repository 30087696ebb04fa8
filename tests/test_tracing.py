"""OpenTelemetry traces of requests (coordinator.observability.tracing) on the real server (`pdserve serve`, 1P+1D,
two HTTP processes, UCX between the workers): a disaggregated request's trace continues the client's traceparent,
has one span per phase interval, contiguous, whose durations sum per phase to what the phase histogram observed;
it reaches a real OTLP/HTTP receiver (protobuf, decoded with opentelemetry-proto) and the JSON-lines file alike; an
unsampled traceparent is honoured, a malformed one starts a fresh trace. Settings are checked by name."""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from coordinator.config.settings import ServerSettings
from coordinator.observability.phases import PHASES, PhaseTrace
from tests.phase_checks import WITH_PHASES
from tests.server_process import HALF_CPU, OPERATOR, metric_values, poll, running_server

pytestmark = pytest.mark.timeout(300)


class Collector:
    """An OTLP/HTTP trace receiver on a free loopback port: every span it is sent, as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for resource in request.resource_spans:
                        service = {a.key: a.value.string_value for a in resource.resource.attributes}
                        for scope in resource.scope_spans:
                            spans.extend(_span(s, service) for s in scope.spans)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, timeout_s: float = 60.0) -> list[dict]:
        """The spans of `trace_id`, once its root has arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = [s for s in list(self.spans) if s["trace_id"] == trace_id]
            if any(s["name"] == "pdserve.request" for s in spans):
                return spans
            time.sleep(0.2)
        raise AssertionError(f"no root span of trace {trace_id} within {timeout_s} s: {self.spans[:3]}")

    def close(self) -> None:
        self._server.shutdown()


def _span(s, service: dict) -> dict:
    values = {}
    for a in s.attributes:
        v = a.value
        values[a.key] = (v.string_value if v.HasField("string_value") else v.int_value if v.HasField("int_value")
                         else [x.string_value for x in v.array_value.values])
    return {"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(), "parent_span_id": s.parent_span_id.hex() or None,
            "name": s.name, "start_unix_nano": s.start_time_unix_nano, "end_unix_nano": s.end_time_unix_nano,
            "attributes": values, "service": service.get("service.name")}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    collector = Collector()
    path = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    config = {"model": "tiny", "dtype": "float32", "mode": "disaggregated", "prefill": HALF_CPU, "decode": HALF_CPU,
              "transfer": {"backends": ["ucx"]},
              "server": {"api_processes": 2, "otlp_traces_endpoint": collector.url, "traces_file": str(path),
                         "admin_api": True}}
    try:
        with running_server(tmp_path_factory.mktemp("tracing"), config) as server:
            yield server.url, collector, path
    finally:
        collector.close()


def _phase_sums(url: str) -> dict[str, float]:
    values = metric_values(url, "pdserve_request_phase_seconds_sum")
    return {p: values.get(f'{{phase="{p}"}}', 0.0) for p in PHASES}


def _ended(url: str) -> float:
    """Requests whose phases the histogram observed (every request has an overhead phase)."""
    return metric_values(url, "pdserve_request_phase_seconds_count").get('{phase="overhead"}', 0.0)


def _stream(url: str, traceparent: str | None) -> str:
    body = {"model": "tiny", "prompt": "tracing one request " * 20, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **WITH_PHASES}
    headers = {"traceparent": traceparent} if traceparent else {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return r.headers["x-request-id"]


def _set_faults(url: str, faults: dict) -> None:
    r = httpx.post(f"{url}/admin/faults", headers=OPERATOR, json=faults, timeout=30)
    assert r.status_code == 200, r.text


def _wait_ended(url: str, at_least: float) -> None:
    deadline = time.monotonic() + 60
    while _ended(url) < at_least and time.monotonic() < deadline:  # observed at the request's close
        time.sleep(0.1)


def test_a_disaggregated_request_is_one_trace_under_the_clients_span_with_a_span_per_phase(traced):
    url, collector, path = traced
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    before, ended = _phase_sums(url), _ended(url)
    # decode steps slowed, so the decode phase has a span however the tokens are coalesced (a loaded CI once had
    # every token reach the coordinator with the join: no decode interval)
    _set_faults(url, {"slow_step_s": 0.02, "slow_workers": ["decode-0"]})
    try:
        request_id = _stream(url, f"00-{trace_id}-{parent_id}-01")
    finally:
        _set_faults(url, {})
    _wait_ended(url, ended + 1)
    after = _phase_sums(url)
    spans = collector.trace(trace_id)
    root = next(s for s in spans if s["name"] == "pdserve.request")
    assert root["parent_span_id"] == parent_id and root["service"] == "pdserve"
    attributes = root["attributes"]
    assert attributes["pdserve.request_id"] == request_id and attributes["pdserve.outcome"] == "finished"
    assert attributes["pdserve.placement"] == "remote"
    assert attributes["pdserve.prefill_worker"].startswith("prefill") and attributes["gen_ai.usage.output_tokens"] == 12
    assert attributes["pdserve.decode_worker"].startswith("decode")
    children = sorted((s for s in spans if s is not root), key=lambda s: s["start_unix_nano"])
    assert children and all(s["parent_span_id"] == root["span_id"] for s in children)
    assert {"ingress", "admission", "prefill_compute", "kv_transfer", "decode"} <= {s["name"] for s in children}
    assert {s["name"] for s in children} <= set(PHASES)
    # contiguous from the arrival to the end: the intervals partition the request as its phases do
    assert children[0]["start_unix_nano"] == root["start_unix_nano"]
    assert children[-1]["end_unix_nano"] == root["end_unix_nano"]
    for a, b in zip(children, children[1:], strict=False):
        assert abs(b["start_unix_nano"] - a["end_unix_nano"]) <= 1, (a, b)
    # a phase's spans sum to what the phase histogram observed for this request (the only one in the window)
    for phase in PHASES:
        spans_s = math.fsum((s["end_unix_nano"] - s["start_unix_nano"]) / 1e9 for s in children if s["name"] == phase)
        assert spans_s == pytest.approx(after[phase] - before[phase], abs=2e-6), phase
    # the file exporter wrote the same spans
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        in_file = {s["span_id"] for s in lines if s["trace_id"] == trace_id}
        if in_file >= {s["span_id"] for s in spans}:
            break
        time.sleep(0.2)
    assert in_file == {s["span_id"] for s in spans}


def test_an_unsampled_traceparent_is_honoured_and_a_malformed_one_starts_a_new_trace(traced):
    url, collector, _ = traced
    unsampled = secrets.token_hex(16)
    _stream(url, f"00-{unsampled}-{secrets.token_hex(8)}-00")
    malformed_id = _stream(url, "00-not-a-trace-context")
    fresh = secrets.token_hex(16)
    _stream(url, f"00-{fresh}-{secrets.token_hex(8)}-01")
    collector.trace(fresh)

    def malformed() -> list[dict]:  # each HTTP process exports its own batches: the order of arrival is not theirs
        return [s for s in list(collector.spans)
                if s["name"] == "pdserve.request" and s["attributes"]["pdserve.request_id"] == malformed_id]
    found = poll(malformed, 60)
    assert len(found) == 1 and found[0]["parent_span_id"] is None
    assert not [s for s in collector.spans if s["trace_id"] == unsampled]


def test_the_trace_keeps_its_intervals_merged_and_in_order():
    trace = PhaseTrace(10.0)
    trace.mark("ingress", 10.001)
    trace.mark("admission", 10.003)
    trace.split([("prefill_queue", 0.002), ("prefill_compute", 0.004)], 10.010)  # 1 ms left: overhead
    for t in (10.011, 10.012, 10.013):
        trace.mark("decode", t)  # one interval, however many tokens
    phases = trace.finish(10.015)
    intervals = trace.intervals()
    assert [p for p, _, _ in intervals] == ["ingress", "admission", "prefill_queue", "prefill_compute", "overhead",
                                            "decode", "overhead"]
    assert intervals[0][1] == 10.0 and intervals[-1][2] == 10.015
    assert all(a[2] == b[1] for a, b in zip(intervals, intervals[1:], strict=False))
    for phase, seconds in phases.items():
        assert math.fsum(e - s for p, s, e in intervals if p == phase) == pytest.approx(seconds)


@pytest.mark.parametrize(("field", "value"), [("otlp_traces_endpoint", "collector:4318"),
                                              ("trace_sample_ratio", 1.5), ("trace_sample_ratio", float("nan")),
                                              ("traces_file", "")])
def test_tracing_settings_are_checked_by_name(field, value):
    with pytest.raises(ValueError, match=f"ServerSettings.{field}"):
        ServerSettings(**{field: value})
