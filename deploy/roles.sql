-- Production role setup, run by a database administrator (a superuser, or a role with CREATEROLE) before
-- `exports migrate`, connected to the exports database, in one transaction:
--
--   psql -X -d exports -v owner_password=... -v app_password=... -v dispatcher_password=... \
--        -v reconciler_password=... -f deploy/roles.sql
--
-- Run again, it changes nothing but the passwords (rotate them that way). A missing or empty password stops it
-- before anything is written. The migration creates the three application roles only when they are missing
-- (without passwords, as the local stack needs); creating them here first gives them passwords. Roles mapped
-- to an identity provider instead can be created the same way and their passwords removed by the DBA.
\set ON_ERROR_STOP on

\if :{?owner_password}
\else
DO $$ BEGIN RAISE EXCEPTION 'roles.sql: set -v owner_password=... (the usage is on its first lines)'; END $$;
\endif
\if :{?app_password}
\else
DO $$ BEGIN RAISE EXCEPTION 'roles.sql: set -v app_password=... (the usage is on its first lines)'; END $$;
\endif
\if :{?dispatcher_password}
\else
DO $$ BEGIN RAISE EXCEPTION 'roles.sql: set -v dispatcher_password=... (the usage is on its first lines)'; END $$;
\endif
\if :{?reconciler_password}
\else
DO $$ BEGIN RAISE EXCEPTION 'roles.sql: set -v reconciler_password=... (the usage is on its first lines)'; END $$;
\endif

-- An empty password would remove the role's password (PostgreSQL stores NULL), never what was meant.
SELECT :'owner_password' = '' OR :'app_password' = '' OR :'dispatcher_password' = ''
       OR :'reconciler_password' = '' AS empty_password \gset
\if :empty_password
DO $$ BEGIN RAISE EXCEPTION 'roles.sql: a password is empty'; END $$;
\endif

BEGIN;

-- Created only when missing (roles are cluster-wide: another database on the server may already have them);
-- the attributes and passwords below are set every time, so a second run converges on the same roles.
SELECT format('CREATE ROLE %I', name)
  FROM unnest(ARRAY['exports_owner', 'exports_app', 'exports_dispatcher', 'exports_reconciler']) AS name
 WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = name) \gexec

-- None of them needs more than LOGIN: the owner owns the tables it creates, and the migration creates no role
-- that exists already. (Only a superuser may change SUPERUSER, REPLICATION or BYPASSRLS; they are checked below.)
ALTER ROLE exports_owner LOGIN NOCREATEDB NOCREATEROLE PASSWORD :'owner_password';  -- migrations; owns the tables
ALTER ROLE exports_app LOGIN NOCREATEDB NOCREATEROLE PASSWORD :'app_password';      -- activities and the starter
ALTER ROLE exports_dispatcher LOGIN NOCREATEDB NOCREATEROLE
    PASSWORD :'dispatcher_password';                                                -- outbox.published_at only
ALTER ROLE exports_reconciler LOGIN NOCREATEDB NOCREATEROLE
    PASSWORD :'reconciler_password';                                                -- corrections; operators only

-- Row-level security and the event triggers bind every role but the owner: a superuser or BYPASSRLS role
-- would pass them all. Roles that already existed with either attribute stop the script (nothing is kept).
SELECT EXISTS (SELECT FROM pg_catalog.pg_roles
                WHERE rolname IN ('exports_app', 'exports_dispatcher', 'exports_reconciler')
                  AND (rolsuper OR rolbypassrls)) AS too_strong \gset
\if :too_strong
DO $$ BEGIN RAISE EXCEPTION 'roles.sql: exports_app, exports_dispatcher and exports_reconciler must be '
    'neither SUPERUSER nor BYPASSRLS (ALTER ROLE ... NOSUPERUSER NOBYPASSRLS as a superuser first)'; END $$;
\endif

-- The owner creates the tables in this database's public schema (PostgreSQL 15 and later no longer let every
-- role create there).
SELECT format('GRANT CONNECT, CREATE ON DATABASE %I TO exports_owner', current_database()) \gexec
GRANT USAGE, CREATE ON SCHEMA public TO exports_owner;
SELECT format('GRANT CONNECT ON DATABASE %I TO exports_app, exports_dispatcher, exports_reconciler',
              current_database()) \gexec

COMMIT;
