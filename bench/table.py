"""One row per measure, each beside its external baseline measured in the same run, printed as one table and
written as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Row:
    id: str
    measure: str
    unit: str
    project: float | None
    baseline: float | None
    baseline_name: str
    goal: str  # e.g. ">= 1.1"; compared with the ratio; "" for a measure without a goal
    higher_is_better: bool = True
    goal_on: str = "ratio"  # or "project": an absolute goal on the project's own value, in its unit
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """Project against baseline, oriented so that more is better whatever the unit."""
        if not self.project or not self.baseline:
            return None
        return self.project / self.baseline if self.higher_is_better else self.baseline / self.project

    @property
    def met(self) -> bool | None:
        value = self.project if self.goal_on == "project" else self.ratio
        if value is None or not self.goal:
            return None  # measured for what it says, with no goal
        op, bound = self.goal.split()[:2]
        return value >= float(bound) if op == ">=" else value <= float(bound)


def middle(values: list[T]) -> T:
    """The median of an odd number of measurements (the middle one: no average of two)."""
    return sorted(values)[len(values) // 2]


def render(rows: list[Row]) -> str:
    header = ("id", "measure", "project", "baseline", "ratio", "goal", "met")
    lines = []
    for r in rows:
        lines.append((r.id, r.measure, _value(r.project, r.unit), f"{_value(r.baseline, r.unit)} ({r.baseline_name})",
                      "-" if r.ratio is None else f"{r.ratio:.2f}", r.goal or "-",
                      "-" if r.met is None else ("yes" if r.met else "NO")))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in lines]
    for r in rows:
        out += [f"{r.id}: {note}" for note in r.notes]
    return "\n".join(out)


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


def write_json(rows: list[Row], path: Path, **context: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**context, "rows": [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in rows]},
                               indent=2) + "\n")
