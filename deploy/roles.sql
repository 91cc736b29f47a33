-- Production role setup, run once by a database administrator before `exports migrate`.
-- The migration creates the roles only when they are missing (without passwords, as the local stack needs);
-- creating them here first lets you give them passwords, or map them to your identity provider instead.
-- psql -v app_password=... -v dispatcher_password=... -v reconciler_password=... -f deploy/roles.sql
CREATE ROLE exports_owner LOGIN PASSWORD :'owner_password';        -- runs the migrations; owns the tables
CREATE ROLE exports_app LOGIN PASSWORD :'app_password';            -- activities and the starter
CREATE ROLE exports_dispatcher LOGIN PASSWORD :'dispatcher_password';  -- outbox.published_at only
CREATE ROLE exports_reconciler LOGIN PASSWORD :'reconciler_password';  -- corrections; held by operators only
GRANT CREATE ON DATABASE exports TO exports_owner;
GRANT CREATE ON SCHEMA public TO exports_owner;
