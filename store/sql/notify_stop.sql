SELECT pg_notify('exports_stop', :job_id);
