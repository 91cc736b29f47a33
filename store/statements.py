"""The documented statements, one .sql file each, loaded by name."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from sqlalchemy import TextClause, text

SQL_DIR = Path(__file__).parent / "sql"


@cache
def statement(name: str) -> TextClause:
    return text((SQL_DIR / f"{name}.sql").read_text())
