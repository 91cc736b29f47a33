-- A request ID is unique per tenant; checked under the job's row lock, so two submissions of one click serialize.
SELECT job_id, requested_by, outcome, found_status, found_attempt_id, found_attempt_count
FROM cancellation_requests WHERE tenant_id = :tenant_id AND id = :request_id;
