-- Whether an uncertain terminal write committed: the row's state and ownership, and this attempt's event of the
-- write's kind, read together. Recovery records its own event kinds, so the event tells this attempt's write
-- from recovery's resolution of the same attempt to the same state.
SELECT j.status, j.attempt_id, j.failure_reason,
       EXISTS (SELECT 1 FROM export_attempt_events e
               WHERE e.job_id = j.id AND e.attempt_id = :attempt_id AND e.kind = :kind) AS event_recorded
FROM export_jobs j
WHERE j.id = :job_id;
