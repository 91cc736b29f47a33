-- The sweeper: a fresh wake-up for every job left Queued longer than the threshold since its last one.
-- Batched, so a large backlog never becomes one long transaction. SKIP LOCKED leaves rows that another writer is
-- changing to the next sweep, and the UPDATE re-checks Queued, so a job that left the queue gets no message.
-- The cutoff is statement_timestamp(), not clock_timestamp(): a volatile function cannot bound an index scan, so
-- with it every sweep read every Queued row of ix_export_jobs_woken to find none due. The update finds each row
-- by the ctid the locking scan saw (stable while locked), not by a second probe of the primary key.
WITH due AS (
    SELECT id, ctid FROM export_jobs
    WHERE status = 'Queued' AND woken_at < statement_timestamp() - make_interval(secs => :threshold_seconds)
    ORDER BY woken_at
    LIMIT :batch
    FOR UPDATE SKIP LOCKED),
swept AS (
    UPDATE export_jobs j
    SET woken_at = clock_timestamp(), sweep_count = j.sweep_count + 1
    FROM due
    WHERE j.ctid = due.ctid AND j.id = due.id AND j.status = 'Queued'
    RETURNING j.id)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM swept;
