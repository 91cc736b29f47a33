"""What later migrations share: their statements run one at a time, and rule functions edited in place (each edit
replaces a known text of the function's current definition, so a migration neither copies an earlier migration's
function nor rewrites one it does not expect)."""

from __future__ import annotations

from collections.abc import Iterable

from alembic import op

Edits = tuple[tuple[str, str], ...]


def edit_function(migration: str, name: str, edits: Edits, *, undo: bool = False) -> str:
    """A DO block that makes each edit (old text -> new, or back with `undo`) in a function's definition, refusing
    if a text to replace is not in it."""
    steps = "".join(f"""
    IF position($old${old}$old$ IN definition) = 0 THEN
        RAISE EXCEPTION 'migration {migration}: {name} is not the function it expects';
    END IF;
    definition := replace(definition, $old${old}$old$, $new${new}$new$);"""
                    for old, new in ((n, o) if undo else (o, n) for o, n in edits))
    return f"""
DO $migration$
DECLARE definition text := pg_get_functiondef('public.{name}'::regproc);
BEGIN{steps}
    EXECUTE definition;
END $migration$"""


def execute_each(statements: Iterable[str]) -> None:
    """One statement per call: `op.execute` sends them one at a time, as asyncpg prepares them."""
    for sql in statements:
        op.execute(sql)
