"""Writes requirements/lock.txt from a virtualenv that installed every extra (`make lock`).

The lock pins every installed distribution except torch, whose build (CPU or CUDA) the
Makefile's TORCH and the Dockerfile's TORCH_SPEC choose, and the project itself. It is used
as a constraints file (`pip install -c requirements/lock.txt ...`): the extras say what is
installed, the lock at which version. tests/test_lock.py checks that it still satisfies
pyproject.toml.

Usage: python tools/write_lock.py VENV_PYTHON OUT
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

UNPINNED = {"torch", "nca-knn"}
HEADER = """\
# Every dependency of every extra, pinned: the constraints `make install` and both Docker
# targets install with (pip install -c requirements/lock.txt ...). torch is not here: its
# build is chosen by the Makefile's TORCH and the Dockerfile's TORCH_SPEC.
# Refresh: make lock   (re-resolves pyproject.toml's ranges in a fresh virtualenv)
"""


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def main(python: str, out: str) -> None:
    frozen = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable", "--all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pins = []
    for line in frozen:
        name, sep, version = line.partition("==")
        if not sep or canonical(name) in UNPINNED or canonical(name) in {"pip", "setuptools"}:
            continue
        pins.append(f"{canonical(name)}=={version.strip()}")
    target = Path(out)
    partial = target.with_suffix(".partial")
    partial.write_text(HEADER + "\n".join(sorted(pins)) + "\n")
    partial.replace(target)
    print(f"wrote {target}: {len(pins)} pins")


if __name__ == "__main__":
    main(*sys.argv[1:3])
