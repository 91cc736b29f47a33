-- State and ownership read together: whether an uncertain claim, cutoff 2 or rename fence committed, and why
-- cutoff 2 was refused (run_gave_up: its run gave it up, run_waits_on_attempt.sql). The version tells an uncertain
-- claim whether the row is still as it checked it.
SELECT j.status, j.attempt_id, j.claimed_by, j.version, j.stop_request_id IS NOT NULL AS stop_recorded,
       j.rename_fence,
       j.lease_expires_at > clock_timestamp() AS lease_current,
       coalesce(j.cutoff_2_given_up = j.attempt_id, false) AS run_gave_up,
       o.status AS original_status
FROM export_jobs j
LEFT JOIN export_jobs o ON o.tenant_id = j.tenant_id AND o.id = j.replaces_job_id
WHERE j.id = :job_id;
