INSERT INTO cancellation_requests (tenant_id, id, job_id, requested_by, reason, outcome, found_status,
                                   found_attempt_id, found_attempt_count, found_delivery_authorized_at)
VALUES (:tenant_id, :request_id, :job_id, :requested_by, :reason, :outcome, :found_status,
        :found_attempt_id, :found_attempt_count, :found_delivery_authorized_at);
