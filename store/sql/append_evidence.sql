-- Delivery evidence: an insert that never touches the job's status, with who observed what. :holder is the build
-- that holds the attempt; the database keeps it only while that build holds the Delivering row (migration 0008),
-- and recovery trusts only evidence that kept it.
INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, recorded_at)
VALUES (:job_id, :attempt_id, 'DeliveryEvidence', CAST(:holder AS text), :observed_by, :detail, clock_timestamp());
