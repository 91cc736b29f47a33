-- Delivery evidence: an insert that never touches the job's status, with who observed what.
INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
VALUES (:job_id, :attempt_id, 'DeliveryEvidence', :observed_by, :detail, clock_timestamp());
