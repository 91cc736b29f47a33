-- A wake-up published: set once, from NULL, so a second dispatcher's late mark changes nothing (the dispatcher
-- role's grants allow no other write; a trigger refuses any other change of published_at).
UPDATE outbox SET published_at = clock_timestamp() WHERE message_id = :message_id AND published_at IS NULL
