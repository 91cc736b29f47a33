-- A run read its row `Running` or `Delivering` and waits for a wake-up: the attempt's own terminal write
-- (finish_delivery.sql, finish_stopped.sql, finish_failed.sql), made by a step that Temporal may have given up
-- without that step knowing it, is to write one. Under the row lock, so the write either comes first (the run
-- reads the row again and finds it settled) or sees this mark. Written like a renewal (the row keeps its lease,
-- as a Running or Delivering row always does), it changes no state, and the change check (migration 0005) passes
-- it by. :given_up, if the run gave this attempt's cutoff 2 up (Temporal's timeout), marks that too: cutoff 2
-- (authorize_delivery.sql) refuses it, since its step may not know (its heartbeats, sent on time, may have reached
-- no server). Only the run's own read names it, never a step of another run or one scheduled before it gave up.
UPDATE export_jobs
SET run_waits_for = attempt_id,
    cutoff_2_given_up = CASE WHEN attempt_id = CAST(:given_up AS uuid) AND status = 'Running' THEN attempt_id
                             ELSE cutoff_2_given_up END
WHERE id = :job_id AND attempt_id = :attempt_id AND status IN ('Running', 'Delivering')
  AND lease_expires_at IS NOT NULL;
