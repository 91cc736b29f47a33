-- A session at the destination's partner for this attempt (migration 0011): the one it holds, else the lowest slot
-- under max_sessions that no live attempt holds, while fewer than max_sessions are live (live: the export's row
-- still names that attempt, Running or Delivering). Two attempts after one slot meet at its row lock: the second
-- re-checks it, finds it live and takes nothing (it asks again). No row when every slot is held.
WITH held AS (
    SELECT slot FROM partner_sessions WHERE job_id = :job_id AND attempt_id = :attempt_id),
live AS (
    SELECT s.slot FROM partner_sessions s
    JOIN export_jobs j ON j.id = s.job_id AND j.attempt_id = s.attempt_id AND j.status IN ('Running', 'Delivering')
    WHERE s.destination_id = :destination_id),
taken AS (
    INSERT INTO partner_sessions AS s (destination_id, slot, job_id, attempt_id, taken_at)
    SELECT d.id, n, :job_id, :attempt_id, clock_timestamp()
    FROM destinations d, generate_series(1, d.max_sessions) AS n
    WHERE d.id = :destination_id AND NOT EXISTS (SELECT FROM held)
      AND n NOT IN (SELECT slot FROM live) AND (SELECT count(*) FROM live) < d.max_sessions
    ORDER BY n LIMIT 1
    ON CONFLICT (destination_id, slot) DO UPDATE
    SET job_id = EXCLUDED.job_id, attempt_id = EXCLUDED.attempt_id, taken_at = EXCLUDED.taken_at
    WHERE NOT EXISTS (SELECT FROM export_jobs j WHERE j.id = s.job_id AND j.attempt_id = s.attempt_id
                      AND j.status IN ('Running', 'Delivering'))
    RETURNING slot)
SELECT slot FROM held UNION ALL SELECT slot FROM taken;
