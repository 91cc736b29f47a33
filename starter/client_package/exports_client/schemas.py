"""The contracts as JSON Schema (draft 2020-12), for clients in other languages: one file per model in
`schemas/`, generated from the models and committed; a test fails when they drift apart.

    python -m exports_client.schemas            # writes schemas/*.json
    python -m exports_client.schemas --check    # exit status 1 when a committed file differs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from exports_client.contracts import CancellationResult, CancelRequest, ExportInput, ExportResult, JobRow, Wake

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"

# What a client sends is validated (the schema of what the worker accepts: aliases included); what it receives is
# serialized (the schema of what the worker writes).
CONTRACTS: dict[str, tuple[type[BaseModel], Literal["validation", "serialization"], str]] = {
    "export-input": (ExportInput, "validation", "The input of a start of workflow type ExportWorkflow."),
    "export-result": (ExportResult, "serialization", "What an ExportWorkflow run returns."),
    "cancel-request": (CancelRequest, "validation",
                       "The payload of the `cancel` signal and of the `cancel` Update."),
    "cancellation-result": (CancellationResult, "serialization", "The answer of the `cancel` Update."),
    "export-row": (JobRow, "serialization", "The answer of the `row` query: the export's row as last read."),
    "wake": (Wake, "validation", "The payload of the `wake` signal (the worker's outbox dispatcher sends it)."),
}


def schema_of(name: str) -> str:
    model, mode, description = CONTRACTS[name]
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"{name}.schema.json",
              **model.model_json_schema(mode=mode), "description": description}
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def generated() -> dict[Path, str]:
    return {SCHEMA_DIR / f"{name}.schema.json": schema_of(name) for name in CONTRACTS}


def drifted() -> list[str]:
    """The committed files that differ from the models (or are missing, or are left over)."""
    expected = generated()
    problems = [f"{path.name}: differs from the model" if path.exists() else f"{path.name}: missing"
                for path, text in expected.items() if not path.exists() or path.read_text() != text]
    problems += [f"{path.name}: no model" for path in SCHEMA_DIR.glob("*.json") if path not in expected]
    return problems


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        problems = drifted()
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    if argv:
        print(__doc__)
        return 2
    SCHEMA_DIR.mkdir(exist_ok=True)
    for path, text in generated().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
