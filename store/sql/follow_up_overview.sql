-- What the evidence follow-up has before it and what it concluded, for operators: every OutcomeUnknown export
-- (pending while it became so within :window_seconds, left for a person after), and the exports it confirmed
-- within that window. Newest first.
SELECT j.id AS job_id, j.tenant_id, j.attempt_id, j.status, j.expected_file_name, u.recorded_at AS unknown_since,
       CASE WHEN j.status = 'Completed' THEN 'confirmed'
            WHEN u.recorded_at > clock_timestamp() - make_interval(secs => :window_seconds) THEN 'pending'
            ELSE 'for a person' END AS state,
       coalesce(f.looks, 0) AS looks, f.last_look_at, coalesce(c.detail, f.finding) AS finding
FROM export_jobs j
JOIN export_attempt_events u ON u.job_id = j.id AND u.attempt_id = j.attempt_id
     AND u.kind IN ('Finished', 'ResolvedByRecovery')
LEFT JOIN evidence_follow_ups f ON f.job_id = j.id AND f.attempt_id = j.attempt_id
LEFT JOIN export_attempt_events c ON c.job_id = j.id AND c.attempt_id = j.attempt_id
     AND c.kind = 'ConfirmedByFollowUp'
WHERE (CAST(:tenant_id AS uuid) IS NULL OR j.tenant_id = CAST(:tenant_id AS uuid))
  AND (j.status = 'OutcomeUnknown'
       OR (c.id IS NOT NULL AND c.recorded_at > clock_timestamp() - make_interval(secs => :window_seconds)))
ORDER BY u.recorded_at DESC
LIMIT :limit;
