"""Grafana dashboard and Prometheus config: every series a panel queries exists in the code.

The metric definitions are found by grepping services/ and shared/ for prometheus_client
and importing those modules; each metric's type gives the series names PromQL may use
(a Counter `x` is queried as `x_total`, a Histogram as `x_bucket/_sum/_count`, a Gauge
as `x`), and its label names the matchers it may take. A panel on a metric nobody
exports (or with a misspelt label) fails here instead of staying empty in Grafana.
"""

from __future__ import annotations

import importlib
import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

from tests.unit.test_deploy_compose import compose

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy/grafana/dashboards/nextstate.json"
PROMETHEUS = REPO / "deploy/prometheus/prometheus.yml"
PROVISIONING = REPO / "deploy/grafana/provisioning"

_DEFINED = re.compile(r'\b(Counter|Gauge|Histogram|Summary)\(\s*"(nextstate_\w+)"')
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count")}


def metric_modules() -> list[str]:
    mods = []
    for path in sorted([*REPO.glob("services/**/*.py"), *REPO.glob("shared/**/*.py")]):
        if "prometheus_client" in path.read_text():
            mods.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return mods


def _metrics_in(value: Any) -> Iterator[MetricWrapperBase]:
    if isinstance(value, MetricWrapperBase):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _metrics_in(v)


def defined_series() -> dict[str, set[str]]:
    """Series name PromQL may use -> the metric's label names."""
    out: dict[str, set[str]] = {}
    for name in metric_modules():
        for value in vars(importlib.import_module(name)).values():
            for metric in _metrics_in(value):
                labels = set(getattr(metric, "_labelnames", ()))
                for family in metric.describe():
                    for suffix in _SUFFIXES[family.type]:
                        out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_grep_and_import_agree() -> None:
    """Every literal definition found by grep is among the imported metrics (so the
    import walk misses nothing), and dynamically named ones are found too."""
    series = defined_series()
    grepped = {
        name for path in [*REPO.glob("services/**/*.py"), *REPO.glob("shared/**/*.py")]
        for _, name in _DEFINED.findall(path.read_text())
    }
    assert grepped, "no metric definitions found"
    for name in grepped:
        assert any(s.startswith(name.removesuffix("_total")) for s in series), name
    assert "nextstate_trainer_reward_mean" in series  # built from a dict of names
    assert "nextstate_judge_call_seconds_bucket" in series
    assert "nextstate_stream_published_total" in series
    assert "nextstate_stream_published" not in series  # a counter is queried with _total


def test_every_queried_series_and_label_is_defined() -> None:
    series = defined_series()
    used = set()
    for title, expr in exprs():
        for name in re.findall(r"\bnextstate_\w+", expr):
            used.add(name)
            assert name in series, f"panel {title!r} queries {name}, which no code defines"
        for name, body in re.findall(r"\b(nextstate_\w+)\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body):
                assert label in series[name], f"panel {title!r}: {name} has no label {label!r}"
        for by in re.findall(r"\bby \(([^)]*)\)", expr):
            names = re.findall(r"\bnextstate_\w+", expr)
            for label in (x.strip() for x in by.split(",")):
                assert any(label in series[n] for n in names), f"panel {title!r}: by {label}"
    assert len(used) >= 20


def test_the_dashboard_covers_the_loop() -> None:
    titles = {t for t, _ in exprs()}
    for needed in ("Turns/s", "Lag per consumer group", "Pending per consumer group",
                   "Judge call latency", "Vote disagreement", "Reward mean", "Staleness",
                   "Policy version", "Weight sync"):
        assert needed in titles, needed
    joined = " ".join(e for _, e in exprs())
    assert "nextstate_stream_group_lag" in joined and "nextstate_stream_group_pending" in joined


def test_the_dashboard_shows_evaluation_and_the_gate() -> None:
    by_title = defaultdict(list)
    for title, expr in exprs():
        by_title[title].append(expr)
    assert "max by (suite) (nextstate_eval_score)" in by_title["Eval score per suite"]
    assert any("nextstate_gate_decisions_total" in e and "by (decision)" in e
               for e in by_title["Gate decisions"])
    assert "max(nextstate_gate_promoted_version)" in by_title["Promoted version"]


def test_panels_use_the_provisioned_datasource() -> None:
    source = yaml.safe_load((PROVISIONING / "datasources/prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid, panel["title"]
            assert all(t["datasource"]["uid"] == uid for t in panel["targets"])


def test_compose_mounts_the_provisioning_and_dashboards() -> None:
    svcs = compose()["services"]
    provider = yaml.safe_load((PROVISIONING / "dashboards/nextstate.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    grafana = svcs["grafana"]
    assert grafana["profiles"] == ["monitoring"] and svcs["prometheus"]["profiles"] == ["monitoring"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./deploy/grafana/dashboards"] == path
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    prom_mounts = {v.split(":")[0]: v.split(":")[1] for v in svcs["prometheus"]["volumes"]}
    assert prom_mounts["./deploy/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_prometheus_scrapes_every_service_on_its_port() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        (name, sd["port"])
        for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name, svc in compose()["services"].items():
        if "build" not in svc or svc.get("restart") == "no":
            continue
        env = svc["environment"]
        argv = [str(a) for a in svc.get("command") or []]
        if argv[:2] == ["ray", "start"]:  # the Ray head: Ray's own process, none of our metrics
            continue
        ports = [v for k, v in env.items() if k.endswith("__PORT")] or [argv[argv.index("--port") + 1]]  # vLLM
        port = int(ports[0])
        aliases = set(svc.get("networks", {}).get("default", {}).get("aliases", []))
        assert any((n, port) in targets for n in {name} | aliases), f"{name}:{port} not scraped"
    assert ("engine", 30000) in targets  # SGLang (--enable-metrics) or the CPU engine
