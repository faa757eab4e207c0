"""The Grafana dashboards under deploy/grafana: well-formed dashboard JSON (the fields
Grafana's importer needs, unique panel ids, panels inside the 24-column grid, every
query on the dashboard's Prometheus variable), and every metric a query names is one
the mesh's code exports (a renamed metric fails here, not on an operator's screen).

No Grafana installs from the package registries here, so the dashboards are not
loaded into one; these checks stand in for that."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
MACRO = re.compile(r'(?:counter|gauge|histogram)!\(\s*"(dpumesh_[a-z0-9_]+)"')
HISTOGRAM = re.compile(r'histogram!\(\s*"(dpumesh_[a-z0-9_]+)"')
QUERIED = re.compile(r"\b(dpumesh_[a-z0-9_]+)\b")


def exported():
    """Metric names the Rust code registers, and which of them are histograms."""
    names, histograms = set(), set()
    for path in ROOT.rglob("*.rs"):
        if "target" in path.parts or ".git" in path.parts:
            continue
        text = path.read_text(errors="replace")
        names.update(MACRO.findall(text))
        histograms.update(HISTOGRAM.findall(text))
    return names, histograms


def test_there_are_dashboards():
    assert {p.name for p in DASHBOARDS} >= {"dpumesh-services.json", "dpumesh-proxy.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_dashboard_is_well_formed(path):
    d = json.loads(path.read_text())
    for key in ("uid", "title", "panels", "schemaVersion", "templating", "time"):
        assert key in d, f"{path.name}: no {key}"
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", d["uid"])
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        assert g["h"] > 0 and g["y"] >= 0, p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            # Variables a query uses are defined.
            for used in re.findall(r"\$([a-z_]+)", t["expr"]):
                assert used.startswith("__") or used in variables, f"{p['title']}: ${used}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_queried_metric_is_exported(path):
    names, histograms = exported()
    assert "dpumesh_requests_total" in names and "dpumesh_request_latency_seconds" in histograms
    d = json.loads(path.read_text())
    queries = [t["expr"] for p in d["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in d["templating"]["list"] if isinstance(v.get("query"), dict)]
    for q in queries:
        for metric in QUERIED.findall(q):
            base = re.sub(r"_(bucket|sum|count)$", "", metric)
            if metric != base:
                assert base in histograms, f"{path.name}: {metric} is not a histogram's series"
            else:
                assert metric in names, f"{path.name}: {metric} is not exported by the mesh"
