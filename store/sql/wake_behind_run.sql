-- A wake-up for an export whose last run closed while the row's state was still to come (a terminated run, say):
-- the dispatcher starts a run that reads the row. One outbox row at most: none while one is still on its way.
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', j.id, clock_timestamp() FROM export_jobs j
WHERE j.id = :job_id
  AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.job_id = j.id AND o.published_at IS NULL);
