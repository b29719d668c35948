"""The dependency rules of DESIGN.md, checked on the source (AST) and at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports (at any depth of the file)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_artifact_module_uses_numpy_and_the_standard_library_only():
    for name in imported_modules(ROOT / "service" / "artifact.py"):
        top = name.split(".")[0]
        assert top in STDLIB or top == "numpy" or name == "service", name


def test_knn_core_uses_numpy_only():
    for name in imported_modules(ROOT / "service" / "knn.py"):
        assert name.split(".")[0] in STDLIB | {"numpy"}, name


def test_training_imports_only_the_numpy_core_of_service():
    allowed = {"service.artifact", "service.knn"}
    for path in package_files("training"):
        for name in imported_modules(path):
            if name.split(".")[0] == "service":
                assert name in allowed, f"{path.name} imports {name}"


def test_service_never_imports_training_or_torch():
    for path in package_files("service"):
        for name in imported_modules(path):
            assert name.split(".")[0] not in {"training", "torch"}, f"{path.name} imports {name}"


def test_importing_the_service_core_leaves_torch_and_the_web_stack_unloaded():
    code = (
        "import sys, service, service.artifact, service.knn\n"
        "bad = [m for m in ('torch', 'fastapi', 'faiss', 'training') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == ""


WEB = {"fastapi", "starlette", "uvicorn", "httpx", "prometheus_client"}
HTTP_LAYER = {
    "service.app",
    "service.deps",
    "service.schemas",
    "service.metrics",
    "service.payload",
}


def test_engine_layer_has_no_web_imports():
    for name in (
        "engine.py",
        "index.py",
        "batcher.py",
        "knn.py",
        "artifact.py",
        "errors.py",
        "config.py",
    ):
        for module in imported_modules(ROOT / "service" / name):
            assert module.split(".")[0] not in WEB, f"service/{name} imports {module}"
            assert module not in HTTP_LAYER and not module.startswith("service.routes"), (
                f"service/{name} imports the HTTP layer ({module})"
            )


def test_importing_the_service_app_leaves_torch_out():
    code = "import sys, service.app, service.__main__\nprint('torch' in sys.modules, 'training' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.split() == ["False", "False"]
