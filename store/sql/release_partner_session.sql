-- The attempt's session slot, given back when its attempt ends on the worker (its upload's end, if it had one), and
-- its place among the destination's waiters. A slot not given back is free once the export's row no longer names
-- the attempt and its upload's hold has lapsed; a place not given back stops counting once its waiter stops asking.
WITH place AS (DELETE FROM partner_session_waits WHERE job_id = :job_id AND attempt_id = :attempt_id)
DELETE FROM partner_sessions WHERE job_id = :job_id AND attempt_id = :attempt_id;
