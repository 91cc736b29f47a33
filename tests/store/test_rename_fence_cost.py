"""GR1's rename-fence rule (migration 0023) looks up the holder's DeliveryEvidence at the commit of every fence pass,
under the job's row lock. Without an index that serves it (found by review), it scanned the whole append-only
export_attempt_events table each time; 0023 indexes the evidence records by export and attempt.

0005's own comment on the rule's lookups: "One kind per lookup, each an equality, so the cached generic plan probes
uq_attempt_transition ... or ix_attempt_builds, and the primary key of export_jobs: nothing planned per call." The
0023 lookup asks for kind = 'DeliveryEvidence', which uq_attempt_transition excludes by its predicate, and no other
index on the table leads with job_id."""

from __future__ import annotations

import json
import time

import pytest

from store.models import Status
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, seed_tenant

# Events of other exports already in the table (a few months of deliveries, each with several evidence records).
BACKLOG = 200_000

# The rule's lookup as migration 0023 writes it into exports_job_change_has_its_event, NEW.* as parameters.
RULE_LOOKUP = (
    "SELECT EXISTS (SELECT 1 FROM public.export_attempt_events e "
    "JOIN public.export_jobs j ON j.id = e.job_id AND j.xmin = e.xmin "
    "WHERE e.job_id = $1 AND e.attempt_id = $2 AND e.kind = 'DeliveryEvidence' AND e.worker_id = $3)")


def _seq_scanned_tables(plan: dict) -> list[str]:
    found = []
    if plan.get("Node Type") == "Seq Scan":
        found.append(plan.get("Relation Name"))
    for child in plan.get("Plans", []):
        found.extend(_seq_scanned_tables(child))
    return found


@pytest.mark.spec("GR1")
async def test_the_rename_fence_rule_finds_its_evidence_by_an_index_not_a_scan_of_every_event(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    others = [await create_job(store, tenant_id, destination_id) for _ in range(20)]
    job_id, early, probe = [await create_job(store, tenant_id, destination_id) for _ in range(3)]
    attempt_id, early_attempt, probe_attempt = [await drive(store, j, Status.DELIVERING)
                                                for j in (job_id, early, probe)]
    # A fence pass while the table holds a handful of events: the baseline.
    started = time.monotonic()
    assert await store.pass_rename_fence(early, early_attempt, "worker-test", "worker", {"step": "rename"})
    baseline = time.monotonic() - started
    # Arranged as the owner: other exports' evidence, as deliveries leave it (the table is never pruned).
    await db.admin.execute(
        "INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, recorded_at) "
        "SELECT ($1::uuid[])[1 + g % 20], gen_random_uuid(), 'DeliveryEvidence', 'worker-' || (g % 7), 'worker', "
        "'{\"step\": \"upload\"}', clock_timestamp() FROM generate_series(1, $2) g", others, BACKLOG)
    await db.admin.execute("ANALYZE export_attempt_events")

    # The lookup as PL/pgSQL runs it: a cached generic plan.
    await db.admin.execute("SET plan_cache_mode = force_generic_plan")
    await db.admin.execute(f"PREPARE rule_lookup(uuid, uuid, text) AS {RULE_LOOKUP}")
    plan = json.loads(await db.admin.fetchval(
        f"EXPLAIN (FORMAT JSON) EXECUTE rule_lookup('{job_id}', '{attempt_id}', 'worker-test')"))[0]["Plan"]
    await db.admin.execute("DEALLOCATE rule_lookup")
    await db.admin.execute("RESET plan_cache_mode")

    # And what it costs the fence pass itself (the application's statement, its deferred check at commit).
    started = time.monotonic()
    assert await store.pass_rename_fence(job_id, attempt_id, "worker-test", "worker", {"step": "rename"})
    took = time.monotonic() - started

    # The rule itself, run (as the owner: the rule checks everyone's writes and lets only the owner's pass anyway)
    # by the same two writes as pass_rename_fence.sql, its deferred check fired at once: how many sequential scans
    # of the events table it made, as the backend counts them in this transaction.
    scans = "SELECT coalesce(seq_scan, 0) FROM pg_stat_xact_user_tables WHERE relname = 'export_attempt_events'"
    async with db.admin.transaction():
        await db.admin.execute("UPDATE export_jobs SET rename_fence = 'passed' WHERE id = $1", probe)
        await db.admin.execute(
            "INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, "
            "recorded_at) VALUES ($1, $2, 'DeliveryEvidence', 'worker-test', 'worker', '{\"step\": \"rename\"}', "
            "clock_timestamp())", probe, probe_attempt)
        before = await db.admin.fetchval(scans)
        await db.admin.execute("SET CONSTRAINTS ALL IMMEDIATE")
        rule_scans = await db.admin.fetchval(scans) - before
        await db.admin.execute("SELECT 1")
    scanned = _seq_scanned_tables(plan)
    assert rule_scans == 0 and "export_attempt_events" not in scanned, (
        f"0023's rule scans every event at each fence pass: {rule_scans} sequential scan(s) of "
        f"export_attempt_events by the rule's check; {scanned} in its lookup's generic plan; the fence pass took "
        f"{took:.3f} s with {BACKLOG} events of other exports in the table, {baseline:.3f} s with a handful")
