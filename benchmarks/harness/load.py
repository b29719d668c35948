"""Load with ``wrk`` (one thread, pinned to LOAD_CORE) and its output parsed: requests/s,
p50 and p99 latency, and errors (non-2xx answers and socket errors)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from harness.servers import LOAD_CORE

# a wrk script posting one instance; fill in its values with LUA % "0.5, 0.5, ..."
LUA = """
wrk.method = "POST"
wrk.body = '{"instances": [[%s]]}'
wrk.headers["Content-Type"] = "application/json"
"""


def parse_wrk(text: str) -> dict:
    def seconds(value: str, unit: str) -> float:
        return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[unit]

    out = {"requests_per_second": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))}
    for pct in ("50", "99"):
        m = re.search(rf"\s{pct}%\s+([\d.]+)(us|ms|s|m)\b", text)
        out[f"p{pct}_ms"] = seconds(*m.groups()) * 1e3 if m else None
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors += int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    errors += sum(map(int, m.groups())) if m else 0
    out["errors"] = errors
    return out


def wrk(url: str, script: Path, connections: int, seconds: int) -> dict:
    cmd = ["taskset", "-c", LOAD_CORE, "wrk", "-t", "1", "-c", str(connections)]
    cmd += ["-d", f"{seconds}s", "--latency", "-s", str(script), url]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return parse_wrk(result.stdout)
