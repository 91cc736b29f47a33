"""The partner's contract, stored with each destination: what identifies a file there, which evidence by content
the partner offers, and whether it writes acknowledgments.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        ALTER TABLE destinations
            -- The partner agreed that name and size alone identify a file (different exports can share a size).
            ADD COLUMN name_and_size_identify boolean NOT NULL DEFAULT false,
            -- Evidence by content: 'none', or 'read_back' (read the final file back and hash it). Neither
            -- asyncssh's server nor OpenSSH offers a hash extension (check-file), so none is modelled yet.
            ADD COLUMN hash_evidence text NOT NULL DEFAULT 'none'
                CONSTRAINT ck_destinations_hash_evidence CHECK (hash_evidence IN ('none', 'read_back')),
            -- Where the partner writes <final name>.ack holding the SHA-256 (hex) of the file it processed.
            ADD COLUMN acknowledgment_dir text
    """)


def downgrade() -> None:
    op.execute("ALTER TABLE destinations DROP COLUMN name_and_size_identify, DROP COLUMN hash_evidence, "
               "DROP COLUMN acknowledgment_dir")
