"""What ships to watch pdserve reads what pdserve exports: every series that the Grafana dashboard
(monitoring/grafana/pdserve.json) and the Prometheus alert rules (monitoring/prometheus/pdserve-alerts.yaml) select
names a family of the real server's /metrics (a histogram only through `_bucket` / `_sum` / `_count`, a counter by
its `_total` name), every label they match or group by is one that family carries, and every value they match exactly
is one it takes; every alert is complete and its runbook_url names a section of docs/runbook.md.

The families come from a real server's scrape (mode adaptive, two HTTP processes, so the adaptive and HTTP-process
families are there; KV handed over, so `pdserve_transfer_*` are; an unknown model asked for, so an error kind is). A
few families or labels appear only in states a short test does not reach (a queue, a learnt placement factor, the
planner's busy share, a migration, a role change, a backend failure, a pool's scale event): those are taken from the
exporter's own code (coordinator.observability.metrics_backend.backend_families) given such figures, and only where
the scrape lacks them. Label values are checked against the scrape alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from coordinator.observability.metrics_backend import backend_families
from tests.promql_names import Reads, reads
from tests.server_process import HALF_CPU, poll, running_server, scrape

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "monitoring" / "grafana" / "pdserve.json"
ALERTS = ROOT / "monitoring" / "prometheus" / "pdserve-alerts.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
ADDED_BY_PROMETHEUS = {"instance", "job"}  # target labels a scrape adds to every series
SEVERITIES = {"info", "warning", "critical"}
# figures that the test server does not reach, shaped as coordinator.backend.stats shapes them
UNREACHED_STATS = {"waiting_by_priority": {"0": 1}, "placement_calibration": {"decode-0/remote": 2.0},
                   "workers": [{"name": "decode-0", "role": "decode", "busy_ratio": 0.5}],
                   "migrations": {"attempted": 1, "outcome_completed": 1, "outcome_failed": 1},
                   "role_changes": {"decode>mixed": 1}, "errors": {"transfer_failed": 1},
                   "scale_events": {"decode/out": 1}}


class Exported:
    """{family as PromQL names it (counters with `_total`): type}, and the labels and values seen per family."""

    def __init__(self) -> None:
        self.types: dict[str, str] = {}
        self.labels: dict[str, set[str]] = {}
        self.values: dict[tuple[str, str], set[str]] = {}  # (family, label) -> values in the scrape

    def family(self, series: str) -> str | None:
        """The family a series name belongs to, or None when none exported has it."""
        if self.types.get(series) in ("counter", "gauge", "recorded"):
            return series
        for suffix in ("_bucket", "_sum", "_count"):
            if series.endswith(suffix) and self.types.get(series[:-len(suffix)]) == "histogram":
                return series[:-len(suffix)]
        return None


def exported_by(metrics_text: str) -> Exported:
    out = Exported()
    out.types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", metrics_text, re.M))
    for name, labels in re.findall(r"^([a-zA-Z_:][\w:]*)(\{.*\})? \S+$", metrics_text, re.M):
        family = out.family(name)
        for label, value in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels):
            out.labels.setdefault(family, set()).add(label)
            out.values.setdefault((family, label), set()).add(value)
    for metric in backend_families(UNREACHED_STATS):
        name = metric.name + "_total" if metric.type == "counter" else metric.name
        out.types.setdefault(name, metric.type)
        if not out.labels.get(name):
            out.labels[name] = {label for sample in metric.samples for label in sample.labels}
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Exported:
    pool = {**HALF_CPU, "max_num_seqs": 16}
    config = {"model": "tiny", "mode": "adaptive", "slo": {"ttft_ms": 500, "tpot_ms": 50},
              "planner": {"enabled": False}, "prefill": pool, "decode": pool, "transfer": {"backends": ["ucx"]},
              "server": {"api_processes": 2}}
    with running_server(tmp_path_factory.mktemp("dashboards"), config) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            body = {"model": "tiny", "prompt": "The sea at night", "max_tokens": 4}
            assert client.post("/v1/completions", json=body).status_code == 200
            assert client.post("/v1/completions", json={**body, "model": "no-such"}).status_code == 404
        # the agents' transfer totals reach the coordinator with the workers' next load reports
        def with_transfers() -> str | None:
            text = scrape(server.url)
            return text if "# TYPE pdserve_transfer_" in text else None
        text = poll(with_transfers, 60)
        assert text, "no pdserve_transfer_* family after a handoff"
        return exported_by(text)


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panels' (rows' nested ones too) targets, and the first argument of
    its query variables' label_values(...)."""
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    out = [t["expr"] for p in panels for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
            assert found, var
            out.append(f"group by ({found.group(2)}) ({found.group(1)})")
    return out


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def problems(expressions: list[str], exported: Exported, recorded: set[str] = frozenset()) -> list[str]:
    """What in `expressions` /metrics does not export: unknown series, labels a family lacks, exact values it never
    takes (recording rules' names in `recorded` count as exported)."""
    found = []
    for expr in expressions:
        parsed: Reads = reads(expr)
        families = []
        for selector in parsed.selectors:
            family = selector.name if selector.name in recorded else exported.family(selector.name)
            if family is None:
                found.append(f"{selector.name}: not exported ({expr})")
                continue
            families.append(family)
            known = exported.labels.get(family, set()) | ADDED_BY_PROMETHEUS
            for label, op, value in selector.matchers:
                if label not in known | {"le"}:
                    found.append(f"{selector.name}: no label {label!r} ({expr})")
                seen = exported.values.get((family, label))
                plain = op == "=" or (op == "=~" and re.fullmatch(r"[\w|]+", value))  # not a variable's regex
                if plain and seen and not set(value.split("|")) <= seen:
                    found.append(f"{selector.name}: {label} never {value!r}, only {sorted(seen)} ({expr})")
        labels = set().union(*(exported.labels.get(f, set()) for f in families), ADDED_BY_PROMETHEUS, {"le"})
        found += [f"groups by {label!r}, which none of its series has ({expr})" for label in parsed.grouping - labels]
    return found


def test_the_dashboard_reads_only_exported_series(exported):
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) > 50
    assert problems(queries, exported) == []


def test_the_alert_rules_read_only_exported_series(exported):
    rules = alert_rules()
    recorded = {rule["record"] for rule in rules if "record" in rule}
    assert problems([rule["expr"] for rule in rules], exported, recorded) == []


def test_a_query_naming_what_is_not_exported_is_found(exported):
    base = 'sum by (le) (rate(pdserve_time_to_first_token_seconds_bucket{instance=~"$instance"}[5m]))'
    assert problems([base], exported) == []
    assert problems([base.replace("first_token", "first_tokens")], exported)  # no such family
    assert problems(["rate(pdserve_time_to_first_token_seconds[5m])"], exported)  # a histogram has no bare series
    assert problems(["rate(pdserve_requests[5m])"], exported)  # a counter is read by its _total name
    assert problems(['pdserve_request_phase_seconds_count{phase="kv_tranfer"}'], exported)  # no such phase
    assert problems(['pdserve_worker_alive{pool="decode"}'], exported)  # no such label
    assert problems(["sum by (tenant) (pdserve_queue_length)"], exported)  # grouped by a label it lacks
    with pytest.raises(ValueError, match="unknown PromQL function"):
        problems(["histogram_quantiles(0.9, pdserve_queue_length)"], exported)


def test_promql_reads_names_labels_and_groupings():
    parsed = reads('sum by (le, phase) (rate(pdserve_request_phase_seconds_bucket{phase=~"a|b",instance=~"$i"}'
                   '[$__rate_interval] offset 5m)) / ignoring(phase) group_left sum(rate(x_total{__name__!="y"}[5m]))'
                   ' > on() group_left() pdserve:target and vllm:num_requests_waiting > 1e-3')
    assert [s.name for s in parsed.selectors] == ["pdserve_request_phase_seconds_bucket", "x_total", "pdserve:target",
                                                  "vllm:num_requests_waiting"]
    assert parsed.selectors[0].matchers == (("phase", "=~", "a|b"), ("instance", "=~", "$i"))
    assert parsed.grouping == {"le", "phase"}
    assert [s.name for s in reads('{__name__="pdserve_queue_length"} * 2').selectors] == ["pdserve_queue_length"]
    assert reads("sum(rate(a[5m])) without (worker)").grouping == {"worker"}
    for bad in ("rate(a{b=}[5m])", "{job=\"x\"}", "sum(a"):
        with pytest.raises(ValueError):
            reads(bad)


def test_every_alert_is_complete_and_links_a_runbook_section():
    anchors = {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), re.M)}
    alerts = [rule for rule in alert_rules() if "alert" in rule]
    assert len(alerts) >= 10 and len({a["alert"] for a in alerts}) == len(alerts)
    for alert in alerts:
        assert {"expr", "for", "labels", "annotations"} <= set(alert), alert["alert"]
        assert re.fullmatch(r"\d+[smh]", alert["for"]), alert["alert"]
        assert alert["labels"]["severity"] in SEVERITIES, alert["alert"]
        notes = alert["annotations"]
        assert notes["summary"] and notes["description"], alert["alert"]
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/runbook.md" and anchor in anchors, (alert["alert"], anchor, sorted(anchors))


def test_the_dashboard_imports_with_any_prometheus():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in (p for p in panels if p["type"] != "row"):
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"] and all(t["datasource"] == source for t in panel["targets"]), panel["title"]
        assert panel["description"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_runbook_is_linked_from_the_docs():
    assert "(runbook.md)" in (ROOT / "docs" / "operations.md").read_text()
    assert "(docs/runbook.md)" in (ROOT / "README.md").read_text()


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
