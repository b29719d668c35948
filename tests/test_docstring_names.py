"""Every module a package's docstring names exists: ``name.py`` or ``name/`` in a package's
``__init__.py`` must be a file or folder of that package, of the repository, or (for test
files) of ``tests/``. Catches the docs drifting from a restructure (a module that became a
package, a file that was renamed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"``([\w./]+(?:\.py|/))``")


def packages() -> list[Path]:
    return sorted(p for top in ("service", "training") for p in (ROOT / top).rglob("__init__.py"))


def exists(name: str, package: Path) -> bool:
    if (package / name).exists() or (ROOT / name).exists():
        return True
    return any((ROOT / "tests").rglob(Path(name).name)) if name.startswith("test") else False


def test_the_modules_package_docstrings_name_exist():
    missing = []
    for init in packages():
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for name in NAMED.findall(doc):
            if not exists(name, init.parent):
                missing.append(f"{init.relative_to(ROOT)} names {name}")
    assert not missing, missing


def test_a_missing_name_is_found():
    assert exists("knn.py", ROOT / "service" / "core")
    assert exists("artifact/", ROOT / "service" / "core")
    assert not exists("artifact.py", ROOT / "service" / "core")
    assert exists("test_artifact_corpus.py", ROOT / "service" / "core")
