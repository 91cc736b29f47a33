"""`make bench`: each measure beside its external baseline, measured in the same run, as one table (and JSON).

    .venv/bin/python -m bench.run [--quick] [--only P3,P6] [--json .exports/bench.json]

Ratios are oriented so that more is better; the goal column is the project's target for each. Never a timed
assertion: a measure that misses its goal is reported, not failed. `--quick` is a smoke run with small sizes, one
round and two measures at once: its numbers say that the benchmarks work, not how fast anything is.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import time
from pathlib import Path

from bench import build, claims, cost, fairness, flood, recovery, scaling, stop, throughput, upload
from bench.table import Row, render, write_json

# What each measure is given: (full run, --quick).
SIZES = {
    "P1": ({"exports": 200, "rounds": 3}, {"exports": 20, "rounds": 1}),
    "P2": ({"samples": 30}, {"samples": 3}),
    "P3": ({"claims": 8000, "rounds": 3}, {"claims": 800, "rounds": 1}),
    "P4": ({"small": 10_000, "large": 1_000_000}, {"small": 10_000, "large": 30_000}),
    "P5": ({"contacts": 900_000, "rounds": 3}, {"contacts": 50_000, "rounds": 1}),
    "P6": ({"megabytes": 200, "rounds": 3}, {"megabytes": 20, "rounds": 1}),
    "S1": ({"exports": 200, "rounds": 3}, {"exports": 20, "rounds": 1, "workers": (2,)}),
    "C1": ({"long_seconds": 60.0, "renew_every": 20.0}, {"long_seconds": 6.0, "renew_every": 2.0}),
    "S2": ({"small": 20, "slow": 110, "slow_megabytes": 5.5}, {"small": 4, "slow": 6, "slow_megabytes": 0.3}),
    "S3": ({"burst": 1000}, {"burst": 24}),
    "C2": ({"malformed": 10_000, "valid": 3_000}, {"malformed": 100, "valid": 20, "quiet_seconds": 0.5}),
}
MEASURES = {"P1": throughput.measure, "P2": stop.measure, "P3": claims.measure, "P4": recovery.measure,
            "P5": build.measure, "P6": upload.measure, "S1": scaling.measure,
            "C1": cost.measure, "S2": fairness.measure_partner, "S3": fairness.measure_tenant,
            "C2": flood.measure}
UNAVAILABLE = {"P6": upload.unavailable}


async def main(quick: bool, only: set[str] | None, json_path: Path) -> int:
    started = time.perf_counter()
    chosen = [measure_id for measure_id in sorted(MEASURES) if not only or measure_id in only]
    # A smoke run's numbers mean nothing, so two measures run at once there: most of a small measure is waiting
    # (processes starting, runs polled), and CI's time is bounded. A full run measures one at a time.
    at_once = asyncio.Semaphore(2 if quick else 1)

    async def measured(measure_id: str) -> list[Row]:
        why_not = UNAVAILABLE.get(measure_id, lambda: None)()
        if why_not:
            return [Row(measure_id, measure_id, "", None, None, "-", "-", notes=[f"skipped: {why_not}"])]
        async with at_once:
            print(f"measuring {measure_id} ...", flush=True)
            began = time.perf_counter()
            rows = await MEASURES[measure_id](**SIZES[measure_id][1 if quick else 0])
            print(f"measured {measure_id} in {time.perf_counter() - began:.0f} s", flush=True)
        return rows if isinstance(rows, list) else [rows]

    rows = [row for measure_rows in await asyncio.gather(*(measured(m) for m in chosen)) for row in measure_rows]
    print()
    print(render(rows))
    took = time.perf_counter() - started
    write_json(rows, json_path, quick=quick, seconds=round(took, 1), cpus=os.cpu_count(),
               machine=platform.platform())
    print(f"\n{len(rows)} measures in {took:.0f} s; written to {json_path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, one round, two measures at once: a smoke run")
    parser.add_argument("--only", default="", help="comma-separated measure IDs, e.g. P3,P6")
    parser.add_argument("--json", default=".exports/bench.json", help="where to write the table as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    only = {m.strip().upper() for m in args.only.split(",") if m.strip()} or None
    raise SystemExit(asyncio.run(main(args.quick, only, Path(args.json))))
