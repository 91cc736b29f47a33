-- The sweeper: a fresh wake-up for every job left Queued longer than the threshold since its last one.
-- Batched, so a large backlog never becomes one long transaction. SKIP LOCKED leaves rows that another writer is
-- changing to the next sweep, and the UPDATE re-checks Queued, so a job that left the queue gets no message.
-- The cutoff is statement_timestamp(), not clock_timestamp(): a volatile function cannot bound an index scan, so
-- with it every sweep read every Queued row of ix_export_jobs_woken to find none due. The update finds each row
-- by the ctid the locking scan saw (stable while locked), not by a second probe of the primary key.
-- A job one of whose wake-ups still waits unpublished (no dispatcher could send it) gets no other: it would wake
-- the run no better, and a long outage would pile up one per threshold. Its woken_at moves on all the same, so
-- it is looked at again one threshold later; sweep_count counts only wake-ups written (migration 0019's index).
WITH due AS (
    SELECT id, ctid,
           EXISTS (SELECT 1 FROM outbox o WHERE o.job_id = export_jobs.id AND o.published_at IS NULL) AS unsent
    FROM export_jobs
    WHERE status = 'Queued' AND woken_at < statement_timestamp() - make_interval(secs => :threshold_seconds)
    ORDER BY woken_at
    LIMIT :batch
    FOR UPDATE SKIP LOCKED),
swept AS (
    UPDATE export_jobs j
    SET woken_at = clock_timestamp(), sweep_count = j.sweep_count + CASE WHEN due.unsent THEN 0 ELSE 1 END
    FROM due
    WHERE j.ctid = due.ctid AND j.id = due.id AND j.status = 'Queued'
    RETURNING j.id, due.unsent),
woken AS (
    INSERT INTO outbox (message_id, kind, job_id, created_at)
    SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM swept WHERE NOT unsent
    RETURNING job_id)
SELECT (SELECT count(*) FROM swept) AS looked_at, (SELECT count(*) FROM woken) AS republished
