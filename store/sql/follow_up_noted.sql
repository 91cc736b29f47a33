-- One look of the evidence follow-up at an OutcomeUnknown export, and what it found: counted, the last finding
-- kept. Nothing is noted for an export that has moved on (reconciled since the listing).
INSERT INTO evidence_follow_ups AS f (job_id, attempt_id, looks, first_look_at, last_look_at, finding)
SELECT id, attempt_id, 1, clock_timestamp(), clock_timestamp(), :finding
FROM export_jobs WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'OutcomeUnknown'
ON CONFLICT (job_id) DO UPDATE
SET looks = CASE WHEN f.attempt_id = excluded.attempt_id THEN f.looks + 1 ELSE 1 END,
    first_look_at = CASE WHEN f.attempt_id = excluded.attempt_id THEN f.first_look_at ELSE excluded.first_look_at END,
    attempt_id = excluded.attempt_id, last_look_at = excluded.last_look_at, finding = excluded.finding;
