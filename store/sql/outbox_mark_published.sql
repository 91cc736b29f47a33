-- Wake-ups published: each set once, from NULL, so a second dispatcher's late mark changes nothing (the dispatcher
-- role's grants allow no other write; a trigger refuses any other change of published_at). A pass marks the rows
-- it published side by side in one statement.
UPDATE outbox SET published_at = clock_timestamp() WHERE message_id = ANY(:message_ids) AND published_at IS NULL
