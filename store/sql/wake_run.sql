-- A wake-up for an export's run that waits for one: the read after a cutoff 2 given up found the row Queued and
-- claimable, and claims nothing itself (its run claims once woken). Always a new outbox row, even with another
-- one unpublished: the dispatcher signals a row before it marks it published, so an older row may already have
-- woken the run before its read began, and that wake-up was spent. One per give-up at most.
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM export_jobs WHERE id = :job_id;
