"""The assets in deploy/: the Grafana dashboard and the Prometheus rules, the systemd unit, the Docker files and the
Kubernetes manifests.

Every metric name in every PromQL expression must be one the server really exports, checked against a live
registry (``Metrics()`` with an admission gate tracked, as the app builds it), or a recording rule defined in
alerts.yml. Counters and histogram series must be read through a range (rate/increase), never raw. The rules are
also checked with ``promtool`` when it is on PATH (Debian: ``apt-get install -y prometheus``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from edgecache.admission import AdmissionGate
from edgecache.ledger import Ledger
from edgecache.metrics import Metrics
from tests.nvml_double import FakeGpu, nvml_module

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "edgecache.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"

DATASOURCE_UID = "${datasource}"
SEVERITIES = {"critical", "warning", "info"}
# What the dashboard must show; each family must appear in at least one panel.
DASHBOARD_MUST_SHOW = (
    "edgecache_requests_total", "edgecache_ttft_seconds_bucket", "edgecache_engine_cached_tokens_total",
    "edgecache_engine_prompt_tokens_total", "edgecache_engine_kv_usage_ratio", "edgecache_semantic_index_vectors",
    "edgecache_semantic_search_seconds_bucket", "edgecache_embed_seconds_bucket",
    "edgecache_semantic_guard_rejections_total", "edgecache_store_bytes", "edgecache_store_quota_bytes",
    "edgecache_admission_queue_depth", "edgecache_admission_running", "edgecache_admission_rejections_total",
)
# What the row "What the cache saved" shows: the ledger (saved by layer, spent by purpose, cost), the misses by
# reason and how near they came, and the GPU's busy share.
SAVED_ROW = "What the cache saved"
SAVED_ROW_MUST_SHOW = (
    "edgecache_saved_engine_seconds_total", "edgecache_saved_cost_total", "edgecache_saved_prompt_tokens_total",
    "edgecache_saved_completion_tokens_total", "edgecache_spent_engine_seconds_total", "edgecache_misses_total",
    "edgecache_semantic_miss_similarity_bucket", "edgecache_gpu_utilization_ratio",
)

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("", "_count", "_sum", "_created"), "gauge": ("",), "info": ("_info",),
            "stateset": ("",), "gaugehistogram": ("_bucket", "_gcount", "_gsum"), "unknown": ("",)}
# Suffixes of series that only make sense through rate()/increase() over a range.
RANGE_ONLY = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}

PROMQL_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                   "offset", "inf", "nan", "start", "end", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBER = re.compile(r"(?<![\w:])\d[\w.]*")


# ---------------------------------------------------------------------------------------------------- helpers


def exported_metrics() -> dict[str, str]:
    """Series names the server exports -> the type of their family, from a live registry as the app builds it (the
    ledger's collector with a box price, as the runtime registers it), on a box where NVML reports a GPU
    (tests/nvml_double.py), so the GPU gauges count only if the app registers them."""
    names: dict[str, str] = {}
    with mock.patch.dict(sys.modules, {"pynvml": nvml_module([FakeGpu("Tesla T4", 35, 2**30, 15 * 2**30)])}):
        metrics = Metrics()
        metrics.track_admission(AdmissionGate(max_running=1, max_queue=1, queue_timeout_s=1, retry_after_s=1))
        metrics.registry.register(Ledger(price_per_hour=1.0, currency="USD").collector())
        for family in metrics.registry.collect():
            for suffix in SUFFIXES[family.type]:
                names[family.name + suffix] = family.type
            for sample in family.samples:
                names.setdefault(sample.name, family.type)
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (functions, keywords, labels, strings, ranges dropped)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if word.lower() in PROMQL_KEYWORDS or re.match(r"\s*\(", text[m.end():]):
            continue  # keyword, or a function/aggregation call
        names.add(word)
    return names


def raw_counter_uses(expr: str, exported: dict[str, str]) -> list[str]:
    """Counter / histogram series read without a range selector (e.g. sum(edgecache_requests_total))."""
    text = _STRING.sub('""', expr)
    bad = []
    for m in _IDENT.finditer(text):
        name = m.group(0)
        kind = exported.get(name)
        if kind is None or not name.endswith(RANGE_ONLY.get(kind, ())) or re.match(r"\s*\(", text[m.end():]):
            continue
        rest = re.sub(r"^\s*\{[^}]*\}", "", text[m.end():])
        if not rest.lstrip().startswith("["):
            bad.append(name)
    return bad


def problems(expr: str, exported: dict[str, str], recorded: set[str]) -> list[str]:
    found = metric_names(expr)
    out = [f"unknown metric {n!r}" for n in sorted(found - exported.keys() - recorded)]
    out += [f"{n!r} read without a range (use rate/increase)" for n in raw_counter_uses(expr, exported)]
    if "histogram_quantile" in expr:
        for m in re.finditer(r"histogram_quantile\s*\(", expr):
            if not re.search(r"\bby\s*\([^)]*\ble\b", expr[m.end():]):
                out.append("histogram_quantile without aggregation 'by (le, ...)'")
    if not found:
        out.append("selects no metric at all")
    return out


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def load_rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def all_panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))  # panels inside collapsed rows


def data_panels(dash: dict) -> list[dict]:
    return [p for p in all_panels(dash["panels"]) if p.get("type") not in ("row", "text")]


def dashboard_exprs(dash: dict) -> Iterator[tuple[str, str]]:
    for p in data_panels(dash):
        for t in p.get("targets", []):
            yield f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]


def rules(doc: dict) -> Iterator[dict]:
    for group in doc["groups"]:
        yield from group["rules"]


def recorded_names(doc: dict) -> set[str]:
    return {r["record"] for r in rules(doc) if "record" in r}


def expanded(expr: str, doc: dict) -> str:
    """The expression with recording-rule names replaced by what they record (for content checks)."""
    recorded = {r["record"]: r["expr"] for r in rules(doc) if "record" in r}
    for name, body in recorded.items():
        expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", f"({body})", expr)
    return expr


def alert(doc: dict, name: str) -> dict:
    matches = [r for r in rules(doc) if r.get("alert") == name]
    assert len(matches) == 1, f"alert {name} defined {len(matches)} times"
    return matches[0]


# ---------------------------------------------------------------------------------------------------- checker


def test_exported_metrics_come_from_the_live_registry() -> None:
    exported = exported_metrics()
    assert exported["edgecache_requests_total"] == "counter"
    assert exported["edgecache_ttft_seconds_bucket"] == "histogram"
    assert exported["edgecache_admission_queue_depth"] == "gauge"
    assert "edgecache_requests" not in exported  # a counter is only scraped with its suffix


@pytest.mark.parametrize("expr, complaint", [
    ("sum(rate(edgecache_request_total[5m]))", "unknown metric 'edgecache_request_total'"),
    ("histogram_quantile(0.99, sum by (le) (rate(edgecache_ttft_seconds[5m])))", "unknown metric"),
    ("sum(edgecache_requests_total)", "without a range"),
    ("histogram_quantile(0.99, rate(edgecache_ttft_seconds_bucket[5m]))", "without aggregation"),
    ('edgecache_store_bytes{tenant="a"} / edgecache_store_quota_byte', "unknown metric"),
])
def test_checker_catches_bad_expressions(expr: str, complaint: str) -> None:
    found = problems(expr, exported_metrics(), set())
    assert any(complaint in p for p in found), found


def test_checker_accepts_good_expressions_and_ignores_labels_and_functions() -> None:
    expr = ('sum by (tenant, outcome) (rate(edgecache_requests_total{outcome=~"exact|semantic"}[$__rate_interval]))'
            ' / ignoring(outcome) group_left() sum by (tenant) (rate(edgecache_requests_total[1d] offset 30m))'
            ' > 0.5 * max(edgecache_ttft_p99_target_seconds)')
    assert metric_names(expr) == {"edgecache_requests_total", "edgecache_ttft_p99_target_seconds"}
    assert problems(expr, exported_metrics(), set()) == []


# ---------------------------------------------------------------------------------------------------- dashboard


def test_dashboard_parses_with_variables() -> None:
    dash = load_dashboard()
    assert dash["title"] and dash["uid"]
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("tenant", "scenario"):
        var = variables[name]
        assert var["type"] == "query" and var["multi"] and var["includeAll"], name
        assert var["datasource"]["uid"] == DATASOURCE_UID
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert re.fullmatch(rf"label_values\(edgecache_requests_total(\{{[^}}]*\}})?,\s*{name}\)", query), query


def test_every_panel_has_a_datasource_and_targets() -> None:
    dash = load_dashboard()
    panels = data_panels(dash)
    assert len(panels) >= 12
    ids = [p["id"] for p in all_panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p.get("title"), p
        assert p.get("datasource", {}).get("uid") == DATASOURCE_UID, p["title"]
        assert set(p["gridPos"]) >= {"h", "w", "x", "y"}, p["title"]
        assert p.get("targets"), f"panel {p['title']!r} has no targets"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t.get("expr", "").strip(), p["title"]
            assert t.get("datasource", {}).get("uid", DATASOURCE_UID) == DATASOURCE_UID, p["title"]


def test_dashboard_expressions_use_only_exported_metrics() -> None:
    exported = exported_metrics()
    dash = load_dashboard()
    errors = [f"{where}: {p}" for where, expr in dashboard_exprs(dash) for p in problems(expr, exported, set())]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            metric = re.match(r"label_values\(\s*([a-zA-Z_:][\w:]*)", query)
            if not metric or metric.group(1) not in exported:
                errors.append(f"variable {var['name']}: {query!r} names no exported metric")
    assert errors == []


def test_dashboard_shows_the_issue_6_metric_set() -> None:
    used = set().union(*(metric_names(expr) for _, expr in dashboard_exprs(load_dashboard())))
    assert set(DASHBOARD_MUST_SHOW) - used == set()


def test_the_saved_row_shows_the_ledger_by_tenant_and_layer_and_the_misses_by_reason() -> None:
    dash = load_dashboard()
    top = dash["panels"]
    start = next(i for i, p in enumerate(top) if p["type"] == "row" and p["title"] == SAVED_ROW)
    end = next((i for i, p in enumerate(top) if i > start and p["type"] == "row"), len(top))
    row = top[start + 1:end] + top[start].get("panels", [])
    exprs = {t["expr"] for p in row for t in p["targets"]}
    used = set().union(*(metric_names(e) for e in exprs))
    assert set(SAVED_ROW_MUST_SHOW) - used == set()
    assert any("by (tenant, layer)" in e and "edgecache_saved_engine_seconds_total" in e for e in exprs)
    assert any("by (tenant, layer, currency)" in e and "edgecache_saved_cost_total" in e for e in exprs)
    assert any("by (reason)" in e and "edgecache_misses_total" in e for e in exprs)
    stacked = [p for p in row if "edgecache_misses_total" in str(p["targets"])
               and p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"]
    assert stacked, "misses by reason are stacked"
    for e in exprs:  # the tenant's figures follow the tenant and scenario pickers
        for m in re.finditer(r"edgecache_(?:saved|spent)_\w+_total(\{[^}]*\})?", e):
            assert m.group(1) and '"$tenant"' in m.group(1) and '"$scenario"' in m.group(1), e


def test_dashboard_filters_requests_by_tenant_and_scenario() -> None:
    for where, expr in dashboard_exprs(load_dashboard()):
        for m in re.finditer(r"edgecache_requests_total(\{[^}]*\})?", expr):
            assert m.group(1) and '"$tenant"' in m.group(1) and '"$scenario"' in m.group(1), where


# ---------------------------------------------------------------------------------------------------- rules


def test_rules_have_the_prometheus_rule_file_structure() -> None:
    doc = load_rules()
    assert set(doc) == {"groups"}
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names)) and all(names)
    allowed = {"alert": {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"},
               "record": {"record", "expr", "labels"}}
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"}, group["name"]
        assert group["rules"], group["name"]
        for rule in group["rules"]:
            kind = "alert" if "alert" in rule else "record"
            assert ("alert" in rule) != ("record" in rule), rule
            assert set(rule) <= allowed[kind], rule
            assert isinstance(rule["expr"], str) and rule["expr"].strip(), rule
            if kind == "record":
                assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"]), rule["record"]
                assert ":" in rule["record"], f"recording rule {rule['record']} should be named level:metric:ops"
            else:
                assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", rule["alert"]), rule["alert"]
                assert re.fullmatch(r"(\d+[smhdwy])+", str(rule["for"])), rule["alert"]
                assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
                assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip()


def test_rule_expressions_use_only_exported_metrics_or_recorded_ones() -> None:
    exported, doc = exported_metrics(), load_rules()
    recorded = recorded_names(doc)
    assert not recorded & exported.keys(), "a recording rule must not shadow an exported metric"
    errors = [f"{r.get('alert') or r.get('record')}: {p}"
              for r in rules(doc) for p in problems(r["expr"], exported, recorded)]
    assert errors == []


def test_hit_rate_alert_compares_with_its_24h_average_per_tenant() -> None:
    doc = load_rules()
    rule = alert(doc, "EdgeCacheHitRateHalved")
    assert "avg_over_time" in rule["expr"] and "[24h]" in rule["expr"] and "0.5 *" in rule["expr"]
    body = expanded(rule["expr"], doc)
    assert "edgecache_requests_total" in body and "tenant" in body
    assert re.search(r'outcome=~"exact\|semantic\|shared"', body)
    assert re.search(r'outcome!~"error\|rejected"', body)
    assert re.search(r"\band\b", rule["expr"]), "needs a low-traffic guard"


def test_ttft_alert_reads_the_threshold_from_the_profile_gauge() -> None:
    doc = load_rules()
    rule = alert(doc, "EdgeCacheTTFTP99OverTarget")
    body = expanded(rule["expr"], doc)
    assert re.search(r"histogram_quantile\(\s*0\.99", body)
    assert "edgecache_ttft_seconds_bucket" in body
    assert "edgecache_ttft_p99_target_seconds" in rule["expr"]


def test_store_quota_alert() -> None:
    rule = alert(load_rules(), "EdgeCacheStoreAtQuota")
    assert re.search(r"edgecache_store_bytes\s*/\s*\(?\s*edgecache_store_quota_bytes", rule["expr"])
    assert "> 0.95" in rule["expr"] and rule["for"] == "15m"


def test_admission_and_guard_alerts_exist() -> None:
    doc = load_rules()
    assert "edgecache_admission_rejections_total" in alert(doc, "EdgeCacheAdmissionRejections")["expr"]
    assert "edgecache_semantic_guard_rejections_total" in alert(doc, "EdgeCacheSemanticGuardRejectionsSpike")["expr"]


def test_ledger_rules_compare_saved_with_spent_engine_seconds_per_instance_and_tenant() -> None:
    doc = load_rules()
    recorded = {r["record"]: r["expr"] for r in rules(doc) if "record" in r}
    for level in ("instance", "tenant"):
        for name in (f"{level}:edgecache_effective_capacity:ratio_rate1h", f"{level}:edgecache_cache_work_share:ratio_rate1h"):
            body = expanded(recorded[name], doc)
            assert "edgecache_saved_engine_seconds_total" in body and "edgecache_spent_engine_seconds_total" in body
            assert "> 0" in recorded[name], f"{name} must leave no figure where nothing was spent"


def test_miss_reason_alert_compares_each_reason_with_the_day_before_per_tenant() -> None:
    doc = load_rules()
    rule = alert(doc, "EdgeCacheMissReasonShift")
    body = expanded(rule["expr"], doc)
    assert "edgecache_misses_total" in body and "offset 1h" in body and "[1d]" in body
    assert re.search(r"by \(tenant, reason\)", body)
    assert len(re.findall(r"\band on \(tenant\)", body)) >= 2, "needs a floor on the misses now and the day before"
    assert rule["for"] == "30m"


# ---------------------------------------------------------------------------------------------------- promtool

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not on PATH (Debian: apt-get install -y prometheus); rules checked by parsing only")


@needs_promtool
def test_promtool_check_rules() -> None:
    result = subprocess.run([promtool, "check", "rules", str(RULES)], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_fire_the_alerts() -> None:
    result = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], check=False, capture_output=True,
                            text=True, timeout=120, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------- supervised deployment

UNIT = ROOT / "deploy" / "systemd" / "edgecache.service"
ENV_EXAMPLE = ROOT / "deploy" / "systemd" / "edgecache.env.example"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "docker" / "Dockerfile.dockerignore"
COMPOSE = ROOT / "deploy" / "docker" / "docker-compose.yml"
TENANTS_EXAMPLE = ROOT / "deploy" / "docker" / "tenants.example.toml"
ROUTER_DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile.router"
KUBERNETES = ROOT / "deploy" / "kubernetes"
# systemd 254 added these two (the growing back-off); an older systemd-analyze warns that it does not know them.
NEWER_SYSTEMD_KEYS = ("RestartSteps", "RestartMaxDelaySec")


def unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as section -> key -> values (a key may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"not a unit line: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_the_unit_restarts_on_failure_with_a_back_off_and_keeps_its_data_and_keys() -> None:
    unit = unit_sections(UNIT.read_text())
    service = unit["Service"]
    assert service["Restart"] == ["on-failure"]
    assert service["RestartSec"] and service["RestartSteps"] and service["RestartMaxDelaySec"]
    assert int(unit["Unit"]["StartLimitBurst"][0]) >= 2 and unit["Unit"]["StartLimitIntervalSec"]
    assert service["StateDirectory"] == ["edgecache"]
    assert "EDGECACHE_DATA_DIR=/var/lib/edgecache" in service["Environment"]
    assert "/var/lib/edgecache" in service["ReadWritePaths"]
    assert service["EnvironmentFile"] == ["-/etc/edgecache/edgecache.env"]
    # serve's refusals of its configuration exit 2: systemd stops there instead of restarting into the same refusal
    assert "2" in " ".join(service["RestartPreventExitStatus"]).split()
    exec_start = service["ExecStart"][0].split()
    assert exec_start[0].endswith("/edgecache") and exec_start[1] == "serve"
    assert service["KillSignal"] == ["SIGTERM"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # every variable the example sets or shows is a real setting or one of the command line's own
    names = [line.lstrip("# ").split("=", 1)[0] for line in ENV_EXAMPLE.read_text().splitlines()
             if line.lstrip("# ").startswith("EDGECACHE_")]
    assert names
    for name in names:
        check_env_name(name)


def unit_environment() -> dict[str, str]:
    return dict(value.split("=", 1) for value in unit_sections(UNIT.read_text())["Service"]["Environment"])


def test_the_unit_binds_a_public_address_only_with_a_tenants_file() -> None:
    exec_start = unit_sections(UNIT.read_text())["Service"]["ExecStart"][0].split()
    host = exec_start[exec_start.index("--host") + 1] if "--host" in exec_start else "127.0.0.1"
    if host not in ("127.0.0.1", "localhost", "::1"):
        assert "--insecure" not in exec_start
        assert "--tenants" in exec_start or unit_environment().get("EDGECACHE_TENANTS_FILE"), \
            "serve refuses a public address without a tenants file"


def test_the_unit_without_its_tenants_file_fails_once_with_one_line(tmp_path: Path) -> None:
    """The unit's own command and environment on a box that lacks the tenants file: exit 2 (which the unit does not
    restart) and one line naming the file, before any model loads."""
    import os
    import socket

    environment = unit_environment()
    if Path(environment["EDGECACHE_TENANTS_FILE"]).exists():
        pytest.skip(f"{environment['EDGECACHE_TENANTS_FILE']} exists on this box")
    words = unit_sections(UNIT.read_text())["Service"]["ExecStart"][0].split()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    args = [port if words[i - 1] == "--port" else word for i, word in enumerate(words) if i > 0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")}
    env |= environment | {"EDGECACHE_DATA_DIR": str(tmp_path / "data")}
    result = subprocess.run([sys.executable, "-m", "edgecache.cli.main", *args], env=env, capture_output=True,
                            text=True, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "tenants file not found" in errors[0] and environment["EDGECACHE_TENANTS_FILE"] in errors[0]


def check_env_name(name: str) -> None:
    from edgecache.settings import NOT_OVERRIDES, env_overrides, iter_fields

    if name in NOT_OVERRIDES:
        return
    dotted = next(iter(env_overrides({name: "x"})))
    assert dotted in {path for path, _ in iter_fields()}, f"{name} names no setting ({dotted})"


systemd_analyze = shutil.which("systemd-analyze")


@pytest.mark.skipif(systemd_analyze is None, reason="systemd-analyze not on PATH (not a systemd box); the unit is "
                    "checked by parsing only")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # verify insists that ExecStart's program exists: point it at this environment's edgecache.
    import sys

    program = Path(sys.executable).with_name("edgecache")
    if not program.exists():
        pytest.skip(f"{program} is not installed (pip install -e .)")
    unit = tmp_path / "edgecache.service"
    unit.write_text(UNIT.read_text().replace("/opt/edgecache/.venv/bin/edgecache", str(program)))
    result = subprocess.run([systemd_analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()
                  and not any(f"Unknown key '{key}'" in line for key in NEWER_SYSTEMD_KEYS)]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, out = "", []
    for raw in text.splitlines():
        line = raw.strip()
        if not joined and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        joined += line
        word, _, rest = joined.partition(" ")
        out.append((word.upper(), rest.strip()))
        joined = ""
    return out


def test_the_dockerfile_builds_llama_cpp_portably() -> None:
    steps = dockerfile_instructions(DOCKERFILE.read_text())
    assert [w for w, _ in steps if w == "FROM"] == ["FROM", "FROM"]  # a build stage and a slim one
    cmake_args = next(rest for w, rest in steps if w == "ENV" and rest.startswith("CMAKE_ARGS="))
    flags = dict(f.split("=", 1) for f in cmake_args.removeprefix("CMAKE_ARGS=").strip('"').split())
    assert flags["-DGGML_NATIVE"] == "OFF"
    for on in ("-DGGML_AVX2", "-DGGML_FMA", "-DGGML_F16C"):  # named: SOURCE_DATE_EPOCH would turn them off
        assert flags[on] == "ON"
    for off in ("-DGGML_AVX512", "-DGGML_AMX_TILE", "-DGGML_AMX_INT8"):
        assert flags[off] == "OFF"
    installs = [rest for w, rest in steps if w == "RUN" and "pip install" in rest and "llama-cpp-python" in rest]
    assert installs and "--no-binary llama-cpp-python" in installs[0] and "--no-cache-dir" in installs[0]
    assert ".[cpu]" in installs[0]
    # the image copies exactly what the package needs, and the ignore file lets exactly that through
    copied = {source for w, rest in steps if w == "COPY" and not rest.startswith("--from")
              for source in rest.split()[:-1]}
    allowed = {line.lstrip("!").rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
               if line.startswith("!")}
    assert copied == allowed == {"pyproject.toml", "README.md", "edgecache", "cli", "profiles"}
    for name in copied:
        assert (ROOT / name).exists()
    assert any(w == "HEALTHCHECK" and "/health" in rest for w, rest in steps)
    assert any(w == "USER" and rest == "edgecache" for w, rest in steps)
    entry = json.loads(next(rest for w, rest in steps if w == "ENTRYPOINT"))
    command = json.loads(next(rest for w, rest in steps if w == "CMD"))
    assert entry == ["edgecache"] and command[0] == "serve" and "--tenants" in command


def test_compose_runs_three_nodes_and_redis() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    nodes = {name: s for name, s in services.items() if name not in ("redis", "router")}
    assert set(nodes) == {"node1", "node2", "node3"}
    assert services["redis"]["healthcheck"]["test"]
    ports, volumes = set(), set()
    for node in nodes.values():
        assert node["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert (COMPOSE.parent / node["build"]["context"] / node["build"]["dockerfile"]).resolve() == DOCKERFILE
        command = node["command"]
        assert command[0] == "serve" and command[command.index("--redis") + 1] == "redis://redis:6379/0"
        assert node["depends_on"]["redis"]["condition"] == "service_healthy"
        assert node["restart"] == "on-failure"
        data = [v for v in node["volumes"] if v.endswith(":/var/lib/edgecache")]
        assert len(data) == 1
        volumes.add(data[0])
        ports.update(node["ports"])
        tenants = next(v for v in node["volumes"] if "/etc/edgecache/tenants.toml" in v)
        assert command[command.index("--tenants") + 1] == "/etc/edgecache/tenants.toml" and tenants.endswith(":ro")
    assert len(volumes) == 3 and len(ports) == 3  # each node its own data dir and its own port
    assert {v.split(":")[0] for v in volumes} <= set(compose["volumes"])


def test_the_tenants_example_loads() -> None:
    from edgecache.tenants import TenantDirectory

    directory = TenantDirectory.from_file(str(TENANTS_EXAMPLE))
    assert directory.get("acme") is not None


def router_requirement() -> str:
    """The sglang-router the dev extra pins (tests/test_router.py runs it): the images must build the same one."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    return next(r for r in extra if r.startswith("sglang-router=="))


def test_compose_puts_the_router_in_front_of_every_node() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    router = services["router"]
    nodes = sorted(name for name in services if name.startswith("node"))
    command = router["command"]
    urls = command[command.index("--worker-urls") + 1:]
    assert urls == [f"http://{name}:8000" for name in nodes]
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert all(router["depends_on"][name]["condition"] == "service_healthy" for name in nodes)
    assert (COMPOSE.parent / router["build"]["context"] / router["build"]["dockerfile"]).resolve() == \
        ROUTER_DOCKERFILE
    version = router_requirement().split("==")[1]
    assert router["image"].endswith(":" + version)
    steps = dockerfile_instructions(ROUTER_DOCKERFILE.read_text())
    assert any(w == "RUN" and router_requirement() in rest for w, rest in steps)
    assert json.loads(next(rest for w, rest in steps if w == "ENTRYPOINT")) == \
        ["python", "-m", "sglang_router.launch_router"]
    assert not any(w in ("COPY", "ADD") for w, _ in steps)


# ------------------------------------------------------------------------------------------------- Kubernetes

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")


def kubernetes_validate(*paths: Path, version: str) -> subprocess.CompletedProcess[str]:
    """The kubernetes-validate command (the dev extra installs it), strict: an unknown field is an error too."""
    import sys

    program = Path(sys.executable).with_name("kubernetes-validate")
    assert program.exists(), "kubernetes-validate is not installed (pip install -e '.[dev]'; .ci/run does)"
    return subprocess.run([str(program), "--strict", "--quiet", "-k", version, *map(str, paths)],
                          capture_output=True, text=True, timeout=120, check=False)


def manifests() -> list[Path]:
    return sorted(p for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def resources() -> dict[tuple[str, str], dict]:
    """(kind, name) -> resource, over every manifest."""
    out = {}
    for path in manifests():
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_validate_passes_every_manifest(version: str) -> None:
    result = kubernetes_validate(*manifests(), version=version)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("what", "breaks"), [
    ("a misspelt field", lambda s: s.replace("livenessProbe:", "livenesProbe:", 1)),
    ("a number as a word", lambda s: s.replace("replicas: 3", 'replicas: "three"', 1)),
    ("no selector", lambda s: s.replace("  selector:\n    matchLabels:\n      app.kubernetes.io/name: edgecache\n",
                                        "", 1)),
])
def test_kubernetes_validate_fails_a_broken_manifest(tmp_path: Path, what: str, breaks: Any) -> None:
    text = (KUBERNETES / "edgecache.yaml").read_text()
    broken = breaks(text)
    assert broken != text, what
    path = tmp_path / "broken.yaml"
    path.write_text(broken)
    result = kubernetes_validate(path, version=KUBERNETES_VERSIONS[-1])
    assert result.returncode != 0, (what, result.stdout)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifests())


def test_the_nodes_keep_their_data_on_a_volume_with_keys_from_the_secret_and_probes_on_health(
        tmp_path: Path) -> None:
    found = resources()
    nodes = found[("StatefulSet", "edgecache")]
    pod = nodes["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[0] == "serve" and args[args.index("--redis") + 1] == "redis://redis:6379/0"
    port = container["ports"][0]["containerPort"]
    assert args[args.index("--port") + 1] == str(port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert [t["metadata"]["name"] for t in nodes["spec"]["volumeClaimTemplates"]] == ["data"]
    assert mounts["data"]["mountPath"] == env["EDGECACHE_DATA_DIR"] == "/var/lib/edgecache"
    tenants_path = args[args.index("--tenants") + 1]
    assert Path(tenants_path).parent == Path(mounts["tenants"]["mountPath"]) and mounts["tenants"]["readOnly"]
    secret_name = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "tenants")
    secret = found[("Secret", secret_name)]
    assert set(secret["stringData"]) == {Path(tenants_path).name}
    from edgecache.tenants import TenantDirectory

    # the example in the Secret is a tenants file the server loads
    path = tmp_path / Path(tenants_path).name
    path.write_text(secret["stringData"][path.name])
    assert TenantDirectory.from_file(str(path)).get("acme") is not None
    # the headless Service names the nodes for the router, and Redis has its Deployment and Service
    service = found[("Service", nodes["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"
    assert found[("Deployment", "redis")] and found[("Service", "redis")]


def test_the_router_names_every_node_and_runs_the_tested_version() -> None:
    found = resources()
    nodes = found[("StatefulSet", "edgecache")]
    router = found[("Deployment", "edgecache-router")]["spec"]["template"]["spec"]["containers"][0]
    args = router["args"]
    urls = args[args.index("--worker-urls") + 1:]
    service, port = nodes["spec"]["serviceName"], nodes["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert urls == [f"http://edgecache-{i}.{service}:{port['containerPort']}" for i in range(nodes["spec"]["replicas"])]
    assert args[args.index("--policy") + 1] == "cache_aware"
    assert router["image"].endswith(":" + router_requirement().split("==")[1])
    assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert found[("Service", "edgecache-router")]
