-- A wake-up for an export whose run would otherwise not read its row again soon: recovery's, for one whose last run
-- closed while the row's state was still to come (a terminated run, say), which the dispatcher starts anew; the
-- read after a cutoff 2 given up, for a row it found Queued, which claims nothing (JobStore.wake_run). One outbox
-- row at most: none while one is still on its way.
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', j.id, clock_timestamp() FROM export_jobs j
WHERE j.id = :job_id
  AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.job_id = j.id AND o.published_at IS NULL);
