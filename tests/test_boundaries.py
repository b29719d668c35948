"""The architecture's rules, checked on the source (AST) and at run time:

1. ``service/core`` (vocabulary, the kNN rule, the artifact format) imports numpy and the
   standard library only; ``service/export`` (the map as ONNX) adds onnx; ``training``
   imports nothing else from ``service``.
2. ``service`` never imports ``training`` or ``torch``; importing ``service.app`` leaves both
   out of ``sys.modules``.
3. The engine, search and the core import no web framework; the two wires (``service/http``
   for /v1, ``service/oip`` for the Open Inference Protocol) never import each other, and
   what they share (``service/wire/``) imports neither and no web framework.
4. No import cycles; rule and index names are spelled only in the vocabulary.
5. The wires reach the engine through its operations only (``Engine.classify``,
   ``neighbors``, ``embed``); a POST /v1/classify never enters the other wire.

The size signals (the longest module, class and function) are a report for reviewers,
``python benchmarks/code_shape.py``, not a test.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_shared_vocabulary_uses_the_standard_library_only():
    for name in imported_modules(ROOT / "service" / "core" / "vocabulary.py"):
        assert name.split(".")[0] in STDLIB, name


def test_the_core_uses_numpy_and_the_standard_library_only():
    """service/core: numpy, the standard library, and itself (plus the package version)."""
    for path in package_files("service/core"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert (
                top in STDLIB
                or top == "numpy"
                or name == "service"
                or name.startswith("service.core")
            ), f"{path.name} imports {name}"


def test_training_imports_only_the_numpy_core_of_service_and_its_export():
    for path in package_files("training"):
        for name in imported_modules(path):
            if name.split(".")[0] == "service":
                assert name.startswith(("service.core", "service.export")), (
                    f"{path.name} imports {name}"
                )


def test_the_export_uses_numpy_onnx_and_the_core_only():
    """service/export (the map as ONNX; training's NCA.to_onnx uses it): no web stack."""
    for path in package_files("service/export"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert (
                top in STDLIB
                or top in ("numpy", "onnx")
                or name == "service"
                or name.startswith(("service.core", "service.export"))
            ), f"{path.name} imports {name}"


def test_service_never_imports_training_or_torch():
    for path in package_files("service"):
        for name in imported_modules(path):
            assert name.split(".")[0] not in {"training", "torch"}, f"{path.name} imports {name}"


def test_importing_the_service_core_leaves_torch_and_the_web_stack_unloaded():
    code = (
        "import sys, service, service.core.artifact, service.core.knn\n"
        "bad = [m for m in ('torch', 'fastapi', 'faiss', 'training') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == ""


WEB = {"fastapi", "starlette", "uvicorn", "httpx", "prometheus_client", "grpc", "msgspec"}


def test_engine_search_and_core_have_no_web_imports():
    """The engine, search, the core, the error table and the settings know no protocol."""
    paths = [
        *package_files("service/core"),
        *package_files("service/engine"),
        *package_files("service/search"),
        ROOT / "service" / "errors.py",
        ROOT / "service" / "config.py",
    ]
    for path in paths:
        for module in imported_modules(path):
            assert module.split(".")[0] not in WEB, f"{path} imports {module}"
            assert not module.startswith(("service.http", "service.oip", "service.app")), (
                f"{path} imports a wire ({module})"
            )


def test_what_the_wires_share_knows_no_framework_and_no_wire():
    """service/wire/ (the caller, media types, bodies, integers, arrays, rows) is shared by
    /v1, /v2 and gRPC: it
    decodes JSON (msgspec) but imports no web framework or server, and no wire."""
    for path in package_files("service/wire"):
        for module in imported_modules(path):
            assert module.split(".")[0] not in WEB - {"msgspec"}, f"{path.name} imports {module}"
            assert not module.startswith(("service.http", "service.oip", "service.app")), module


def test_the_wires_never_import_each_other():
    """service/http (/v1) and service/oip (REST and gRPC) both sit on the engine; neither
    imports the other, and neither imports the application that composes them."""
    for wire, other in (("service/http", "service.oip"), ("service/oip", "service.http")):
        for path in package_files(wire):
            for module in imported_modules(path):
                assert not module.startswith((other, "service.app")), f"{path} imports {module}"


def test_importing_the_service_app_leaves_torch_out():
    code = "import sys, service.app, service.__main__\nprint('torch' in sys.modules, 'training' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.split() == ["False", "False"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports, at any depth (function-local
    imports included: a cycle hidden inside a function is still a cycle)."""
    modules = {module_name(p): p for package in packages for p in package_files(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from a.b import c` imports the module a.b.c when there is one
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_import_cycles_in_service_or_training():
    graph = import_graph(("service", "training"))
    assert "training.objectives.nca" in graph and "service.engine.model" in graph
    assert cycles(graph) == []


TRAINING_FLOORS = [  # bottom to top; a module imports only its own floor and the ones below
    {"numerics", "errors", "publish", "state_file"},
    {"data", "objectives"},
    {"evaluation"},
    {"distributed"},
    {"optim"},
    {"references"},
    {"model"},
    {"progress"},
    {"config"},
    {"job"},
    {"cli", "__main__", "__init__"},
]


def training_floor(module: str) -> int:
    """The floor of ``training.<part>...`` (its sub-package or top-level module)."""
    part = module.split(".")[1] if module.count(".") else "__init__"
    return next(i for i, floor in enumerate(TRAINING_FLOORS) if part in floor)


def test_no_training_module_imports_one_above_it():
    """The job stands on its parts: numerics and errors at the bottom, then data and the
    objectives, evaluation, the collectives, the optimisers, the reference sets, the
    estimator, the progress display, the configuration, the job, and the command line on
    top."""
    graph = import_graph(("training",))
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if training_floor(target) > training_floor(module)
    ]
    assert upward == []


# Imports a training module makes inside a function, and why they cannot be at its top.
LAZY_IMPORTS = {
    # flex attention exists only in some torch builds, and importing it starts the compiler
    "training/objectives/nca_flex.py": {"torch.nn.attention", "torch.nn.attention.flex_attention"},
    # pyplot takes its backend when first imported: Agg is chosen only when the job draws,
    # so importing the report leaves matplotlib's global state to the caller
    "training/evaluation/report.py": {"matplotlib", "matplotlib.pyplot"},
    # onnx (0.1 s and ~27 MiB at import) only when a fitted map is exported
    "training/model/estimator.py": {"service.export.onnx_map"},
    # torch (seconds) only when NCA is first used: `python -m training` sets its signal
    # handlers before the imports (training/__main__.py)
    "training/__init__.py": {"training.model.estimator"},
}


def test_training_imports_at_the_top_of_its_modules():
    found = []
    for path in package_files("training"):
        allowed = LAZY_IMPORTS.get(str(path.relative_to(ROOT)), set())
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    names = {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom):
                    names = {node.module}
                else:
                    continue
                if not names <= allowed:
                    found.append(f"{path.name}:{node.lineno} {function.name} imports {names}")
    assert found == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_rule_and_index_names_are_listed_only_in_the_vocabulary():
    """No tuple, list or set of string constants that spells out two or more decision rules or two
    or more index kinds anywhere but service/core/vocabulary.py (they derive from its enums)."""
    from service.core.vocabulary import INDEX_KINDS, RULES

    offenders = []
    for package in ("service", "training"):
        for path in package_files(package):
            if path.name == "vocabulary.py" and path.parent.name == "core":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                    if len(values & set(RULES)) >= 2 or len(values & set(INDEX_KINDS)) >= 2:
                        offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_the_service_tests_need_only_the_serve_and_dev_extras():
    """tests/service imports neither training nor torch, scikit-learn or scipy, at any depth
    (tests of trained artifacts against the service live in tests/integration)."""
    train_only = {"training", "torch", "sklearn", "scipy", "matplotlib"}
    for path in sorted((ROOT / "tests" / "service").rglob("*.py")):
        for name in imported_modules(path):
            assert name.split(".")[0] not in train_only, f"{path.name} imports {name}"


def test_the_direct_lane_serves_exactly_the_declared_inference_routes():
    from service.http.routes import inference

    declared = {route.path: route.endpoint for route in inference.router.routes}
    assert inference.DIRECT_LANE == {p: e for p, e in declared.items() if "{" not in p}
    named = {p: e for p, e in declared.items() if "{model_name}" in p}
    assert len(named) == len(inference.DIRECT_LANE)  # each route also by a model's name
    for path, endpoint in named.items():
        model, route = inference.named_target(path.replace("{model_name}", "a-model"))
        assert model == "a-model" and inference.DIRECT_LANE[route] is endpoint


ENGINE_PARTS = {"admit", "search", "project", "batcher", "in_flight", "events"}
ENGINE_METRICS = {"request_rows", "outliers", "batch_rows", "queue_wait"}  # its events' series


def test_the_wires_reach_the_engine_only_through_its_operations():
    """/v1 and the OIP wires decode, call ``Engine.classify``, ``neighbors`` or ``embed``
    (which own the in-flight gate, the batcher, the metrics and the outlier flags), and
    encode: no wire touches those parts, the metrics the engine reports, or the kNN core."""
    offenders = []
    for path in [*package_files("service/http"), *package_files("service/oip")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (
                node.attr in ENGINE_PARTS
                or (
                    node.attr in ENGINE_METRICS
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "metrics"
                )
            ):
                offenders.append(f"{path.name}:{node.lineno} .{node.attr}")
        for module in imported_modules(path):
            if module.startswith(("service.core.knn", "service.search", "service.engine.batch")):
                offenders.append(f"{path.name} imports {module}")
    assert offenders == []


@pytest.mark.parametrize("batching", [True, False])
def test_a_v1_classify_request_runs_through_the_engines_operation(tmp_path, batching):
    """Every Python call of one warm request, profiled (benchmarks/request_path.py): it
    passes through the engine's operation and the inference path, and never through the
    other wire (the OIP) or a module outside the request's floors."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from request_path import request_path, synthetic_model
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    files = [name for name, _ in request_path(synthetic_model(tmp_path), batching)]
    assert {"service/engine/engine.py", "service/engine/infer.py"} <= set(files)
    assert files[:2] == ["service/app.py", "service/http/routes/inference.py"]
    floors = ("service/app.py", "service/http/", "service/wire/", "service/engine/")
    floors += ("service/ops/", "service/core/", "service/search/")
    assert [name for name in files if not name.startswith(floors)] == []


FMT_SKIP = re.compile(r"#\s*fmt:\s*(skip|off)\s*$", re.MULTILINE)


def test_no_code_is_packed_past_the_formatter():
    """``# fmt: skip`` only where a table reads better aligned (the dashboard's panels):
    code is never hand-packed to fit a size signal."""
    allowed = {"deploy/monitoring/dashboard.py"}
    marked = [
        str(path.relative_to(ROOT))
        for folder in ("service", "training", "tests", "benchmarks", "deploy", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if FMT_SKIP.search(path.read_text()) and str(path.relative_to(ROOT)) not in allowed
    ]
    assert marked == []


def test_the_tests_mirror_the_packages_and_share_helpers_in_one_place():
    """tests/service/<package>/ and tests/training/<package>/ test that package; a test
    module imports the shared helpers (conftest.py, servers.py, problems.py), never another
    test module."""
    for top in ("service", "training"):
        for folder in sorted(p for p in (ROOT / "tests" / top).iterdir() if p.is_dir()):
            if folder.name != "__pycache__":
                assert (ROOT / top / folder.name / "__init__.py").is_file(), folder
    crossing = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        for module in imported_modules(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert crossing == []
