-- A request to replace a replacement resolves to the original it replaced.
SELECT coalesce(replaces_job_id, id) AS original_job_id
FROM export_jobs WHERE tenant_id = :tenant_id AND id = :job_id;
