-- The evidence follow-up's work: OutcomeUnknown exports that became so within :window_seconds, the least
-- recently looked at first, so that a backlog larger than one run's batch is looked at in turn. Not an export that
-- has a replacement: the follow-up never settles one (follow_up_confirm.sql).
SELECT j.id AS job_id, j.attempt_id, coalesce(f.looks, 0) AS looks
FROM export_jobs j
JOIN export_attempt_events u ON u.job_id = j.id AND u.attempt_id = j.attempt_id
     AND u.kind IN ('Finished', 'ResolvedByRecovery')
LEFT JOIN evidence_follow_ups f ON f.job_id = j.id AND f.attempt_id = j.attempt_id
WHERE j.status = 'OutcomeUnknown'
  AND NOT EXISTS (SELECT FROM export_jobs r WHERE r.tenant_id = j.tenant_id AND r.replaces_job_id = j.id)
  AND u.recorded_at > clock_timestamp() - make_interval(secs => :window_seconds)
ORDER BY f.last_look_at NULLS FIRST, u.recorded_at
LIMIT :limit;
