"""Hash evidence by the SFTP extension `check-file-name`: the partner hashes the final file itself.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        ALTER TABLE destinations
            DROP CONSTRAINT ck_destinations_hash_evidence,
            -- 'check_file': the partner answers check-file-name with the SHA-256 of the final file.
            ADD CONSTRAINT ck_destinations_hash_evidence
                CHECK (hash_evidence IN ('none', 'read_back', 'check_file'))
    """)


def downgrade() -> None:
    # Refused, not rewritten, while a destination relies on the extension: its contract would be lost silently.
    op.execute("""
        ALTER TABLE destinations
            DROP CONSTRAINT ck_destinations_hash_evidence,
            ADD CONSTRAINT ck_destinations_hash_evidence CHECK (hash_evidence IN ('none', 'read_back'))
    """)
