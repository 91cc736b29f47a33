"""What a worker process runs besides its workflows: the steps of an export (they change a job only through
store/), recovery's steps, the builder and the SFTP partner, and the process's plumbing (process/: the Temporal
connection, logging, metrics and probes, tracing, the outbox dispatcher, the scavenger)."""
