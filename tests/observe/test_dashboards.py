"""The Grafana dashboard and the Prometheus alert rules in deploy/observability/, against a real worker's scrape.

(a) Every metric name their queries use appears in a real scrape of a worker process's /metrics, after one
export. (b) Each alert's expression is evaluated by promtool (`promtool test rules`) on series built from that
scrape, its names, labels and values as served: held as scraped, no alert fires (the worker is healthy); with
the series the alert watches moved to its trouble value, that alert, and only that one, fires. The test's copy of
the rules drops the annotations (promtool compares them verbatim; they are text for people); expressions,
`for` durations and labels are the file's own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from store.models import Status
from tests.helpers.support import eventually
from tests.observe.test_metrics import polling, scrape, value, worker_process, world

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
RULES = DEPLOY / "alerts.yml"
DASHBOARD = DEPLOY / "dashboard.json"
METRIC = re.compile(r"\b(?:exports|temporal)_[a-zA-Z0-9_]+")
# Served only once their event has happened (the SDK registers a counter at its first increment): the recovery
# alert's firing case builds it from a served activity series of the same SDK, relabelled.
AFTER_FIRST_EVENT = {"temporal_activity_execution_failed_total"}

Samples = dict[tuple[str, frozenset], float]


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(json.loads(DASHBOARD.read_text()))
    return found


def names_in(expressions: list[str]) -> set[str]:
    return {name for expr in expressions for name in METRIC.findall(expr)}


async def real_scrape(db, store, client, tmp_path: Path) -> Samples:
    """A worker's scrape after one export Completed and a read of the store gauges that followed it."""
    async with world(db, store, client, tmp_path) as h, worker_process(h) as worker:
        await polling(worker.port)
        job_id = await h.create()
        assert (await h.settled(job_id)).status is Status.COMPLETED
        found, _ = await eventually(
            lambda: scrape(worker.port),
            lambda r: value(r[0], "exports_jobs", status="Completed") >= 1
            and value(r[0], "exports_outbox_backlog") == 0,
            timeout=20, interval=0.5, what="the store gauges read after the export")
        return found


async def test_every_metric_the_dashboard_and_the_alerts_use_is_served(db, store, client, tmp_path):
    found = await real_scrape(db, store, client, tmp_path)
    served = {name for name, _ in found}
    queries = dashboard_queries()
    used = names_in(queries) | names_in([rule["expr"] for rule in rules()])
    # A histogram is served as its _bucket, _sum and _count series.
    missing = sorted(name for name in used - AFTER_FIRST_EVENT if name not in served)
    assert not missing, f"not in a real scrape: {missing}; served: {sorted(served)}"
    assert len(queries) >= 10, (queries, " ".join(sorted(served)))


def series(name: str, labels: frozenset, values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
    return {"series": f"{name}{{{inner}}}", "values": values}


HOLD = "x60"  # sixty one-minute steps: longer than any rule's `for`


def promtool_case(found: Samples, used: set[str], trouble: dict[tuple[str, frozenset], str],
                  expected: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    """One promtool test: every served series the rules read, held at its scraped value, but for `trouble`'s."""
    inputs = [series(name, labels, trouble.get((name, labels), f"{v!r}+0{HOLD}"))
              for (name, labels), v in found.items() if name in used]
    inputs += [series(name, labels, values) for (name, labels), values in trouble.items()
               if (name, labels) not in found]
    return {"interval": "1m", "input_series": inputs,
            "alert_rule_test": [{"eval_time": "50m", "alertname": rule["alert"],
                                 "exp_alerts": [{"exp_labels": labels} for labels in expected.get(rule["alert"], [])]}
                                for rule in rules()]}


def pick(found: Samples, name: str, **labels: str) -> list[tuple[str, frozenset]]:
    return [(n, ls) for (n, ls) in found if n == name and all(dict(ls).get(k) == v for k, v in labels.items())]


def troubles(found: Samples) -> dict[str, tuple[dict[tuple[str, frozenset], str], list[dict[str, str]]]]:
    """For each alert: the served series moved to trouble, and the labels of the alerts expected."""
    limit = {dict(ls)["kind"]: v for (n, ls), v in found.items() if n == "exports_worker_slots_limit"}
    activity = pick(found, "temporal_activity_execution_latency_count")
    assert activity, "no activity latency served"
    failed_labels = frozenset({**dict(activity[0][1]), "activity_type": "take_over"}.items())
    return {
        "ExportsOutcomeUnknownWaiting": (
            {key: f"1+0{HOLD}" for key in pick(found, "exports_jobs", status="OutcomeUnknown")},
            [{"severity": "ticket"}]),
        "ExportsOutboxBacklogOld": (
            {key: f"0+60{HOLD}" for key in pick(found, "exports_outbox_oldest_unpublished_age_seconds")},
            [{"severity": "page"}]),
        "ExportsStoreGaugesStale": (
            {key: f"0+0{HOLD}" for key in pick(found, "exports_metrics_store_read_timestamp_seconds")},
            [{"severity": "ticket"}]),
        "ExportsRecoveryErrors": (
            {("temporal_activity_execution_failed_total", failed_labels): f"0+1{HOLD}"},
            [{"severity": "ticket"}]),
        "ExportsLeaseRenewalsFailing": (
            {key: f"0+1{HOLD}" for key in pick(found, "exports_lease_renewals_failed_total", reason="error")},
            [{"severity": "page"}]),
        "ExportsWorkerSlotsSaturated": (
            {key: f"{limit['build']!r}+0{HOLD}"
             for key in pick(found, "exports_worker_slots_in_use", kind="build")},
            [{"severity": "ticket", "kind": "build"}]),
        "ExportsTemporalSlotsExhausted": (
            {key: f"0+0{HOLD}"
             for key in pick(found, "temporal_worker_task_slots_available", worker_type="ActivityWorker")},
            [{"severity": "ticket", "worker_type": "ActivityWorker"}]),
    }


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("EXPORTS_REQUIRE_PROMTOOL"):
            pytest.fail("promtool is required here (EXPORTS_REQUIRE_PROMTOOL) and not installed")
        pytest.skip("promtool not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    return found


async def test_each_alert_fires_on_its_trouble_and_none_fires_on_a_healthy_scrape(db, store, client, tmp_path):
    tool = promtool()
    found = await real_scrape(db, store, client, tmp_path)
    used = names_in([rule["expr"] for rule in rules()])
    cases = troubles(found)
    assert set(cases) == {rule["alert"] for rule in rules()}, "every alert needs its trouble case here"
    for alert, (trouble, _) in cases.items():
        assert trouble, f"{alert}: the series it watches are not served"
    tests = [promtool_case(found, used, {}, {})]
    tests += [promtool_case(found, used, trouble, {alert: labels}) for alert, (trouble, labels) in cases.items()]
    bare = {"groups": [{**group, "rules": [{k: v for k, v in rule.items() if k != "annotations"}
                                           for rule in group["rules"]]}
                       for group in yaml.safe_load(RULES.read_text())["groups"]]}
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(bare))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["alerts.yml"],
                                                        "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([tool, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
