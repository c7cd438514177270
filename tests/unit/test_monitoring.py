"""The chart's Grafana dashboard and alert rules query only what the code exports.

Every metric name in every dashboard query (panels and template variables) and every rule
expression is checked against the families the operator and the sidecar register with
prometheus_client (instantiated here, their names expanded to the samples Prometheus stores:
`_total`, `_bucket`/`_sum`/`_count`), plus the engine's (vLLM's) names listed below. Label
matchers and `by (...)` labels of ember's metrics must be labels those metrics have (or the ones
Prometheus adds when it scrapes). The rule file's structure is validated here, and
`promtool check rules` (built by e2e/build.sh from the Prometheus module; EMBER_PROMTOOL names
another) checks it, and fails a broken copy of it.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from go_tools import built
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

MONITORING = Path(__file__).resolve().parents[2] / "charts" / "ember" / "monitoring"
DASHBOARD = MONITORING / "ember-dashboard.json"
RULES = MONITORING / "ember-rules.yaml"

# vLLM's own metrics (vllm/v1/metrics/loggers.py), served by the engine container on :8000; ember
# does not export them, so they are listed here. Only these may appear under the `vllm:` prefix.
ENGINE_METRICS = {
    "vllm:num_requests_running": set(), "vllm:num_requests_waiting": set(),
    "vllm:time_to_first_token_seconds_bucket": {"le"}, "vllm:generation_tokens_total": set(),
}
# Labels Prometheus attaches to every scraped sample (PodMonitor/ServiceMonitor target labels).
TARGET_LABELS = {"namespace", "pod", "container", "instance", "job", "service", "endpoint"}
FUNCTIONS_AND_KEYWORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "irate", "histogram_quantile", "time",
    "label_values", "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
    "unless", "bool", "offset", "topk", "bottomk", "abs", "clamp_min", "absent", "vector",
}


def exported() -> dict[str, set[str]]:
    """Sample name → label names, for every family the operator and the sidecar register."""
    import ember_operator.metrics  # noqa: F401  (registers the operator's families on REGISTRY)
    from ember_sidecar.metrics import Metrics

    families: list[Metric] = [*REGISTRY.collect(), *Metrics(CollectorRegistry()).registry.collect()]
    labels = _declared_labels()
    names: dict[str, set[str]] = {}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["_sum", "_count"]}
    for family in families:
        if not family.name.startswith("ember_"):
            continue  # process_* / python_* of the default registry
        for suffix in suffixes.get(family.type, [""]):
            le = {"le"} if suffix == "_bucket" else set()
            names[family.name + suffix] = labels.get(family.name, set()) | le
    return names


def _declared_labels() -> dict[str, set[str]]:
    """Label names per family: from the registered collectors' own declarations (a labelled family
    with no child yet has no samples to read them from) and from the state collector's families."""
    import ember_operator.metrics as om
    from ember_sidecar.metrics import Metrics

    out: dict[str, set[str]] = {}
    sidecar = Metrics(CollectorRegistry())
    for collector in [*vars(om).values(), *vars(sidecar).values()]:
        name, names = getattr(collector, "_name", None), getattr(collector, "_labelnames", None)
        if isinstance(name, str) and names is not None:
            out[name.removesuffix("_total")] = set(names)
    state = om.State()
    state.set_warm_pools("ns", {"p": 1})
    state.set_deployment("ns", "md", fallback=1, native=1)
    state.set_archive("ns", "ga", om.Archive("Saving", 1, 1.0, 2.0))
    for family in state.collect():
        for sample in family.samples:
            out.setdefault(family.name, set()).update(sample.labels)
    return out


def dashboard_queries() -> Iterator[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            yield f"variable {var['name']}", query["query"]
    stack = list(dash["panels"])
    while stack:
        panel = stack.pop()
        stack += panel.get("panels") or []
        for target in panel.get("targets") or []:
            yield f"panel {panel['title']!r}", target["expr"]


def rule_queries() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"rule {rule['alert']}", rule["expr"]


def selectors(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric name, labels it is matched or grouped on) for each metric in a PromQL expression
    (or a Grafana `label_values(metric, label)` query)."""
    if m := re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*", expr):
        yield m.group(1), {m.group(2)}
        return
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    grouping = set()
    for clause in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        grouping |= {x.strip() for x in clause.group(1).split(",") if x.strip()}
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    for m in re.finditer(r"(?<![\w:$.])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?", expr):
        name, matchers = m.group(1), m.group(2) or ""
        rest = expr[m.end():].lstrip()
        if name in FUNCTIONS_AND_KEYWORDS or (rest.startswith("(") and not matchers):
            continue
        labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
        yield name, labels | grouping


def all_queries() -> list[tuple[str, str]]:
    return [*dashboard_queries(), *rule_queries()]


def test_queries_name_only_exported_metrics_and_their_labels() -> None:
    names = exported()
    known = {**names, **ENGINE_METRICS}
    problems, used = [], set()
    for where, expr in all_queries():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), (where, expr)
        found = list(selectors(expr))
        assert found, f"{where}: no metric in {expr!r}"
        for name, labels in found:
            used.add(name)
            if name not in known:
                problems.append(f"{where}: {name} is not exported (query {expr!r})")
                continue
            unknown = labels - known[name] - TARGET_LABELS - {"le"}
            if unknown and not name.startswith("vllm:"):
                problems.append(f"{where}: {name} has no label(s) {sorted(unknown)}")
    assert not problems, "\n".join(problems)
    # The dashboard covers what the issue asks: restore stages, fallbacks, claims, SAVEs, sizes.
    for wanted in ("ember_restore_stage_seconds_sum", "ember_restores_total", "ember_restore_fallbacks_total",
                   "ember_claims_total", "ember_saves_total", "ember_archive_bytes", "ember_warm_pods",
                   "ember_save_deadline_timestamp_seconds", "vllm:num_requests_waiting"):
        assert wanted in used, wanted


def test_a_query_of_a_metric_the_code_does_not_export_is_caught() -> None:
    names = exported()
    assert "ember_restore_fallbacks" not in names  # the old gauge's name is gone
    assert names["ember_restores_total"] == {"result", "reason"}
    assert names["ember_restore_stage_seconds_bucket"] == {"stage", "le"}
    assert names["ember_restore_fallbacks_total"] == {"namespace", "deployment", "reason"}
    assert names["ember_warm_pods"] == {"namespace", "pool"}
    bad = list(selectors('sum by (reason) (increase(ember_restore_fallbacks{namespace=~"$ns"}[5m]))'))
    assert bad == [("ember_restore_fallbacks", {"reason", "namespace"})]
    assert [n for n, _ in selectors("time() - max by (a) (ember_x_seconds) > 3")] == ["ember_x_seconds"]


def test_rule_file_structure() -> None:
    doc: dict[str, Any] = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    alerts: list[str] = []
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"].startswith("ember.")
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert re.fullmatch(r"Ember[A-Z]\w+", rule["alert"]), rule["alert"]
            assert "for" not in rule or re.fullmatch(r"\d+[smhd]", rule["for"]), rule
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            assert {"summary", "description"} <= set(rule["annotations"])
            for text in rule["annotations"].values():
                assert text.count("{{") == text.count("}}"), text
            alerts.append(rule["alert"])
    assert len(alerts) == len(set(alerts))
    assert {"EmberRestoreFallbacks", "EmberSaveStuck"} <= set(alerts)


@pytest.fixture(scope="module")
def promtool() -> str:
    return built("promtool", "PROMETHEUS_VERSION", "EMBER_PROMTOOL")


def check_rules(promtool: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rules(promtool: str) -> None:
    proc = check_rules(promtool, RULES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


@pytest.mark.parametrize(("field", "broken", "error"), [
    ("expr", "sum by (namespace) (rate(ember_restores_total[5m])", "unclosed left parenthesis"),
    ("for", "ten minutes", "not a valid duration"),
    ("alert", "", "one of 'record' or 'alert' must be set"),
])
def test_promtool_fails_a_broken_rule(promtool: str, tmp_path: Path, field: str, broken: str,
                                      error: str) -> None:
    doc = yaml.safe_load(RULES.read_text())
    doc["groups"][0]["rules"][0][field] = broken
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = check_rules(promtool, path)
    assert proc.returncode != 0 and error in proc.stdout + proc.stderr, proc.stdout + proc.stderr
