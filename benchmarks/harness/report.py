"""What a benchmark reports: the machine, medians, peak memory, a printed table, and the
raw JSON in ``benchmarks/results/`` (written to a temporary file, then renamed)."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"  # where save_json writes


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB): VmHWM, which starts afresh at
    exec. (getrusage's ru_maxrss survives fork + exec on Linux, so a worker started by a
    parent that once held 750 MiB would report at least 750 MiB.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }


def median(values):
    return statistics.median(values)


def save_json(name: str, payload: dict) -> Path:
    out = RESULTS / name
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float))
    tmp.replace(out)
    return out


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-+-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
