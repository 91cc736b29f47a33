-- The attempt's session slot, given back when its attempt ends on the worker (its upload's end, if it had one). A
-- slot not given back is free once the export's row no longer names the attempt and its upload's hold has lapsed.
DELETE FROM partner_sessions WHERE job_id = :job_id AND attempt_id = :attempt_id;
