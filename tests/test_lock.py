"""requirements/lock.txt: every package pinned, pyproject.toml's ranges satisfied, and the
environment the tests run in installed at the lock's versions (CI installs with the lock as
constraints, so a lock and an install that drift apart fail here). `make lock` refreshes it.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="Python < 3.11: no tomllib")

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    found = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and not re.search(r"[<>=!~,; ]", version), f"not a pin: {line}"
        assert canonical(name) not in found, f"pinned twice: {name}"
        found[canonical(name)] = version
    return found


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        listed += extra
    return [Requirement(r) for r in listed]


def test_every_requirement_of_every_extra_is_pinned_inside_its_range():
    locked = pins()
    assert "torch" not in locked  # its build is the Makefile's and the Dockerfile's choice
    for requirement in project_requirements():
        name = canonical(requirement.name)
        if name == "torch":
            continue
        assert name in locked, f"{requirement} is not in the lock: run make lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"the lock pins {name}=={locked[name]}, outside pyproject.toml's {requirement}: "
            "run make lock"
        )


def test_this_environment_is_installed_at_the_locks_versions():
    mismatched = {}
    for name, version in pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an extra this environment does not install
        if installed != version:
            mismatched[name] = (installed, version)
    assert not mismatched, f"installed != locked: {mismatched}; run make install"


def test_the_makefile_and_both_images_install_with_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    assert "-c requirements/lock.txt" in makefile
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count("pip install --no-cache-dir -c requirements/lock.txt") == 2
