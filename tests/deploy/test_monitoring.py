"""deploy/monitoring: the Grafana dashboard and the Prometheus alert rules, checked offline.

Every query parses (promql-parser, Prometheus's grammar) and names only series the service
exports (service/ops/metrics.py) with labels they carry; the route regexes match the route
labels the service writes; the dashboard JSON is what its generator writes; and where
promtool is installed (Debian: apt-get install prometheus), `promtool check rules` passes
and the alerts' unit tests (alert-rules.test.yaml) fire as stated.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "alert-rules.yaml"


def load_generator():
    spec = importlib.util.spec_from_file_location("dashboard", MONITORING / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_series() -> dict[str, set[str]]:
    """{sample name: its label names} of every series the service's Metrics declare, the
    custom collectors' included."""
    from prometheus_client.metrics import MetricWrapperBase

    series: dict[str, set[str]] = {}
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            # a custom collector (ncaknn_model_info): the families it describes
            for family in getattr(metric, "describe", lambda: ())():
                series[family.name] = set(family._labelnames)
            continue
        labels = set(metric._labelnames)
        names = {
            "counter": [f"{metric._name}_total"],
            "histogram": [f"{metric._name}_{s}" for s in ("bucket", "sum", "count")],
        }.get(metric._type, [metric._name])
        for name in names:
            series[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return series


def rule_list() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard_queries() -> list[str]:
    board = json.loads((MONITORING / "dashboard.json").read_text())
    return [target["expr"] for p in board["panels"] for target in p["targets"]]


def all_queries() -> list[str]:
    return dashboard_queries() + [rule["expr"] for rule in rule_list()]


def test_the_dashboard_is_its_generators_output():
    committed = (MONITORING / "dashboard.json").read_text()
    assert committed == load_generator().render(), "run: python deploy/monitoring/dashboard.py"
    board = json.loads(committed)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"]) >= 10
    assert all(p["datasource"]["uid"] == "${datasource}" for p in board["panels"])


@pytest.mark.parametrize("query", all_queries())
def test_every_query_parses_and_names_only_exported_series(query):
    promql_parser = pytest.importorskip("promql_parser")
    promql_parser.parse(query)  # raises on a syntax error
    series = exported_series()
    for name in re.findall(r"\bncaknn_[a-z_]+\b", query):
        assert name in series, f"{name} is not exported (exported: {sorted(series)})"
    for selector in re.finditer(r"(ncaknn_[a-z_]+)\{([^}]*)\}", query):
        used = set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", selector.group(2)))
        assert used <= series[selector.group(1)], (selector.group(0), series[selector.group(1)])
    for grouping in re.findall(r"by \(([^)]*)\)", query):
        names = set(re.findall(r"ncaknn_[a-z_]+", query))
        labels = {label.strip() for label in grouping.split(",")}
        assert any(labels <= series[name] for name in names), (query, labels)


def test_the_route_regexes_match_the_routes_the_service_labels():
    generator = load_generator()
    inference = re.search(r'route=~"([^"]+)"', generator.INFERENCE).group(1)
    classify = re.search(r'route=~"([^"]+)"', generator.CLASSIFY).group(1)
    for route in (
        "/v1/classify",
        "/v1/embed",
        "/v1/neighbors",
        "/v2/models/{model_name}/infer",
        "grpc inference.GRPCInferenceService/ModelInfer",
    ):
        assert re.fullmatch(inference, route), route  # PromQL regexes are anchored
    for route in (
        "/v1/classify",
        "/v2/models/{model_name}/infer",
        "grpc inference.GRPCInferenceService/ModelInfer",
    ):
        assert re.fullmatch(classify, route), route
    for route in ("/healthz", "/metrics", "unmatched", "/v1/admin/reload"):
        assert not re.fullmatch(inference, route), route


def test_the_alerts_cover_what_operators_page_on():
    rules = {rule["alert"]: rule for rule in rule_list()}
    wanted = {
        "error rate": 'status=~"5.."',
        "p99 latency": "histogram_quantile(0.99",
        "429 rate": 'status="429"',
        "reload failures": "ncaknn_model_load_failures_total",
        "model age": "ncaknn_model_created_timestamp_seconds",
        "outlier rate": "ncaknn_outliers_total",
    }
    for what, needle in wanted.items():
        assert any(needle in rule["expr"] for rule in rules.values()), what
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"page", "ticket"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert re.fullmatch(r"\d+[smhd]", rule.get("for", "0s")), name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules():
    done = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_alerts_fire_on_synthetic_series_and_stay_quiet_below_their_thresholds():
    """alert-rules.test.yaml: an error rate, a failed reload, slow requests (with /healthz
    traffic that must not count) and an outlier rate, each with the alert it must raise
    and when; and a low error rate that must raise none."""
    done = subprocess.run(
        ["promtool", "test", "rules", "alert-rules.test.yaml"],
        cwd=MONITORING,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
