-- The attempt's session slot, given back when its attempt ends on the worker. For speed only: the slot is free for
-- the taking as soon as the export's row no longer names the attempt Running or Delivering.
DELETE FROM partner_sessions WHERE job_id = :job_id AND attempt_id = :attempt_id;
