"""The worker process's plumbing, beside the export's steps: the Temporal connection (temporal.py), logging
(logs.py), the HTTP endpoint for metrics and probes (endpoint.py), the worker's own metrics (metrics.py), tracing
(tracing.py), the outbox dispatcher (dispatcher.py) and the scavenger of built files (scavenger.py).

Nothing here imports starter/: the command line and the client library (starter/) import from here."""
