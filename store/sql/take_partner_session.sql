-- A session at the destination's partner for this attempt (migration 0011): the one it holds, else the lowest slot
-- under max_sessions that no live attempt holds, while fewer than max_sessions are live. A slot is live while the
-- export's row still names its attempt, Running or Delivering, or while that attempt's upload keeps it (0016:
-- `uploading_until` not passed; the upload goes on past a lost lease). Two attempts after one slot meet at its row
-- lock: the second re-checks it, finds it live and takes nothing (it asks again).
-- Waiters are served in the order they began (0020): each ask records the attempt's place (its first ask) and when
-- it asked, and a slot is taken only while the live slots and the live waiters ahead of it leave one: a waiter is
-- live while it asks (within :waiter_seconds), holds no slot yet, and its export's row names its attempt. The
-- order is fairness only: the slots' rows alone keep the limit. A waiter silent for :forget_seconds is forgotten.
-- One row: the destination's limit now (NULL: none, so nothing to wait for, whatever was read before) and the slot
-- held or taken (NULL while every slot is held, or kept for waiters ahead).
WITH held AS (
    SELECT slot FROM partner_sessions WHERE job_id = :job_id AND attempt_id = :attempt_id),
waiting AS (
    INSERT INTO partner_session_waits AS w (job_id, attempt_id, destination_id, since, asked_at)
    SELECT :job_id, :attempt_id, d.id, clock_timestamp(), clock_timestamp()
    FROM destinations d WHERE d.id = :destination_id AND d.max_sessions IS NOT NULL AND NOT EXISTS (SELECT FROM held)
    ON CONFLICT (job_id, attempt_id) DO UPDATE SET asked_at = EXCLUDED.asked_at
    RETURNING w.since),
forgotten AS (
    DELETE FROM partner_session_waits w
    WHERE w.destination_id = :destination_id
      AND w.asked_at < clock_timestamp() - make_interval(secs => :forget_seconds)
      AND NOT (w.job_id = :job_id AND w.attempt_id = :attempt_id)),
ahead AS (
    SELECT count(*) AS waiters FROM partner_session_waits w, waiting me
    WHERE w.destination_id = :destination_id AND (w.since, w.job_id) < (me.since, :job_id)
      AND w.asked_at > clock_timestamp() - make_interval(secs => :waiter_seconds)
      AND NOT EXISTS (SELECT FROM partner_sessions s WHERE s.job_id = w.job_id AND s.attempt_id = w.attempt_id)
      AND EXISTS (SELECT FROM export_jobs j WHERE j.id = w.job_id AND j.attempt_id = w.attempt_id
                  AND j.status IN ('Running', 'Delivering'))),
live AS (
    SELECT s.slot FROM partner_sessions s
    WHERE s.destination_id = :destination_id
      AND (s.uploading_until > clock_timestamp()
           OR EXISTS (SELECT FROM export_jobs j WHERE j.id = s.job_id AND j.attempt_id = s.attempt_id
                      AND j.status IN ('Running', 'Delivering')))),
taken AS (
    INSERT INTO partner_sessions AS s (destination_id, slot, job_id, attempt_id, taken_at)
    SELECT d.id, n, :job_id, :attempt_id, clock_timestamp()
    FROM destinations d, generate_series(1, d.max_sessions) AS n
    WHERE d.id = :destination_id AND NOT EXISTS (SELECT FROM held)
      AND n NOT IN (SELECT slot FROM live)
      AND (SELECT count(*) FROM live) + (SELECT waiters FROM ahead) < d.max_sessions
    ORDER BY n LIMIT 1
    ON CONFLICT (destination_id, slot) DO UPDATE
    SET job_id = EXCLUDED.job_id, attempt_id = EXCLUDED.attempt_id, taken_at = EXCLUDED.taken_at,
        uploading_until = NULL
    WHERE NOT coalesce(s.uploading_until > clock_timestamp(), false)
      AND NOT EXISTS (SELECT FROM export_jobs j WHERE j.id = s.job_id AND j.attempt_id = s.attempt_id
                      AND j.status IN ('Running', 'Delivering'))
    RETURNING slot)
SELECT d.max_sessions, coalesce((SELECT slot FROM held), (SELECT slot FROM taken)) AS slot
FROM destinations d WHERE d.id = :destination_id;
