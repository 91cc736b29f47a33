"""Demo and test data: a tenant's contacts and a destination. Written as the owner (the app may only read them)."""

from __future__ import annotations

import uuid

import asyncpg


async def seed_contacts(conn: asyncpg.Connection, tenant_id: uuid.UUID, count: int) -> None:
    await conn.execute(
        """
        INSERT INTO contacts (tenant_id, email, first_name, last_name, phone)
        SELECT $1::uuid, 'contact' || g || '@' || left($1::uuid::text, 8) || '.example', 'First' || g, 'Last' || g,
               '+1555' || lpad(g::text, 7, '0')
        FROM generate_series(1, $2) AS g
        """,
        tenant_id,
        count,
    )


async def seed_destination(
    conn: asyncpg.Connection,
    tenant_id: uuid.UUID,
    *,
    name: str,
    host: str,
    port: int,
    username: str,
    final_dir: str,
    temp_dir: str,
    host_key: str,
    credential_ref: str,
    enabled: bool = True,
    destination_id: uuid.UUID | None = None,
    name_and_size_identify: bool = False,
    hash_evidence: str = "none",
    acknowledgment_dir: str | None = None,
) -> uuid.UUID:
    """Insert, or with a known ID bring the address, keys and contract up to date (the local partner's port
    changes)."""
    destination_id = destination_id or uuid.uuid4()
    await conn.execute(
        """
        INSERT INTO destinations (id, tenant_id, name, host, port, username, final_dir, temp_dir, host_key,
                                  credential_ref, enabled, name_and_size_identify, hash_evidence, acknowledgment_dir)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
        ON CONFLICT (id) DO UPDATE SET host = excluded.host, port = excluded.port, host_key = excluded.host_key,
            credential_ref = excluded.credential_ref, name_and_size_identify = excluded.name_and_size_identify,
            hash_evidence = excluded.hash_evidence, acknowledgment_dir = excluded.acknowledgment_dir
        """,
        destination_id, tenant_id, name, host, port, username, final_dir, temp_dir, host_key, credential_ref,
        enabled, name_and_size_identify, hash_evidence, acknowledgment_dir,
    )
    return destination_id
