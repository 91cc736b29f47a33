-- How an expired attempt was lost (migrations 0014, 0015), read by recovery before its takeover
-- (recovery_take_back.sql), which counts it against the cap of its kind:
-- * `with_its_worker` when another attempt of the same worker (the holder's worker ID, before any `/<build
--   holder>`) lapsed with it, its lease out or running out within one renewal interval without a renewal, or was
--   taken over by recovery within `:together_seconds`: the worker was lost (killed, paused, cut off), not only this
--   attempt. A live worker renews every attempt it holds, so its others keep at least a lease minus a renewal
--   interval.
-- * `amid_others` when, within the same window, a worker that never held this export was lost too (an attempt of
--   it lapsed, or recovery took one over): workers are being lost whatever they hold, so this loss says nothing
--   about the export. A job that kills each worker it meets is not amid others when nothing else kills workers:
--   every worker lost then once held it.
-- A hand-back (migration 0018: the row names the attempt, recovery's event says `handed back by its worker`) is
-- neither: its worker let the attempt go and lives on.
WITH lost AS (
    SELECT id, split_part(claimed_by, '/', 1) AS holder
    FROM export_jobs
    WHERE id = :job_id AND attempt_id = :attempt_id AND claimed_by IS NOT NULL),
-- Every worker that ever held the export: its claims, builds, evidence and losses name them.
its_workers AS (
    SELECT DISTINCT split_part(e.worker_id, '/', 1) AS worker
    FROM export_attempt_events e, lost
    WHERE e.job_id = lost.id AND e.worker_id IS NOT NULL)
SELECT lost.holder,
       EXISTS (SELECT 1 FROM export_jobs o
               WHERE o.status IN ('Running', 'Delivering')
                 AND o.lease_expires_at < clock_timestamp() + make_interval(secs => :renew_seconds)
                 AND o.handed_back_attempt IS DISTINCT FROM o.attempt_id
                 AND o.id <> lost.id AND split_part(o.claimed_by, '/', 1) = lost.holder)
       OR EXISTS (SELECT 1 FROM export_attempt_events e
                  WHERE e.worker_id = lost.holder AND e.kind IN ('RequeuedByRecovery', 'AttemptsExhausted')
                    AND e.recorded_at > clock_timestamp() - make_interval(secs => :together_seconds)
                    AND e.detail IS DISTINCT FROM 'handed back by its worker'
                    AND e.job_id <> lost.id)
           AS with_its_worker,
       EXISTS (SELECT 1 FROM export_jobs o
               WHERE o.status IN ('Running', 'Delivering') AND o.lease_expires_at < clock_timestamp()
                 AND o.handed_back_attempt IS DISTINCT FROM o.attempt_id
                 AND split_part(o.claimed_by, '/', 1) <> lost.holder
                 AND split_part(o.claimed_by, '/', 1) NOT IN (SELECT worker FROM its_workers))
       OR EXISTS (SELECT 1 FROM export_attempt_events e
                  WHERE e.kind IN ('RequeuedByRecovery', 'AttemptsExhausted') AND e.worker_id IS NOT NULL
                    AND e.recorded_at > clock_timestamp() - make_interval(secs => :together_seconds)
                    AND e.detail IS DISTINCT FROM 'handed back by its worker'
                    AND e.worker_id <> lost.holder
                    AND e.worker_id NOT IN (SELECT worker FROM its_workers))
           AS amid_others
FROM lost;
