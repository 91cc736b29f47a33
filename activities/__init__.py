"""What a worker process runs besides its workflows: the steps of an export (they change a job only through
store/), recovery's steps, the builder and the SFTP partner, and the outbox dispatcher (dispatcher.py)."""
