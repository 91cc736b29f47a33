-- Cutoff 2: Running -> Delivering for this attempt and the build that made the file, only with no stop request and
-- a current lease, which it renews, so the upload starts with a full one; for a replacement, also only while its
-- original is not Completed. FOR SHARE makes a correction of the original and this statement wait for each
-- other, whichever commits first. :not_after is the step's own bound: a step that reaches the database after it
-- (its worker was paused, and the run has moved on) authorizes nothing; nor does one whose run gave it up and
-- said so in its next read (run_waits_on_attempt.sql), which the step's own bound may not show. It opens the
-- attempt's rename fence (pass_rename_fence.sql).
WITH original_open AS (
    SELECT 1 FROM export_jobs
    WHERE tenant_id = :tenant_id AND id = CAST(:replaces_job_id AS uuid) AND status <> 'Completed'
    FOR SHARE),
authorized AS (
    UPDATE export_jobs
    SET status = 'Delivering',
        expected_file_name = :final_name, expected_file_bytes = :length, expected_file_sha256 = :sha256,
        delivery_authorized_at = clock_timestamp(), rename_fence = 'open',
        lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds)
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Running'
      AND claimed_by = coalesce(CAST(:holder AS text), claimed_by)
      AND stop_request_id IS NULL
      AND cutoff_2_given_up IS DISTINCT FROM attempt_id
      AND lease_expires_at > clock_timestamp()
      AND clock_timestamp() < coalesce(CAST(:not_after AS timestamptz), 'infinity')
      AND (CAST(:replaces_job_id AS uuid) IS NULL OR EXISTS (SELECT 1 FROM original_open))
    RETURNING id, attempt_id, delivery_authorized_at)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, detail, recorded_at)
SELECT id, attempt_id, 'DeliveryAuthorized', :final_name, delivery_authorized_at FROM authorized;
