-- The locking read of the cancellation request: this tenant's job row, every column, held until commit.
-- A test compares this column list with the table metadata (MC1).
SELECT id, tenant_id, status, version, destination_id, attempt_id, attempt_count, claimed_by,
       lease_expires_at, stop_request_id, cancellation_request_id, expected_file_name,
       expected_file_bytes, expected_file_sha256, delivery_authorized_at, woken_at, failure_reason,
       delivery_key, replaces_job_id, created_by, replacement_reason, overwrite_agreement_ref,
       sweep_count, confirmed_by, rejection_reason, final_name, rename_fence, handed_back_count, run_waits_for,
       handed_back_attempt, cutoff_2_given_up
FROM export_jobs WHERE id = :job_id AND tenant_id = :tenant_id
FOR UPDATE;
