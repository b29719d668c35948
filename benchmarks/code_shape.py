"""The shape of the code: modules per package folder, and the largest modules, classes and
functions, against the limits the restructure aims at (issue 32: at most 8 modules directly
in a package folder, no module over 600 lines, no class over 350, no function over 60).

Lines are counted from the AST (``end_lineno - lineno + 1``, decorators and docstrings
included). Usage: python benchmarks/code_shape.py [--root DIR] [--json]   (DIR: a checkout;
default this one). Prints the offenders; writes nothing unless --json.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

LIMITS = {"modules_per_folder": 8, "module": 600, "class": 350, "function": 60}
PACKAGES = ("service", "training")


def shape(root: Path) -> dict:
    folders, modules, classes, functions = {}, [], [], []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            folder = str(path.parent.relative_to(root))
            if path.name != "__init__.py":
                folders[folder] = folders.get(folder, 0) + 1
            text = path.read_text()
            modules.append((rel, len(text.splitlines())))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    classes.append((f"{rel}:{node.name}", node.end_lineno - node.lineno + 1))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    size = node.end_lineno - node.lineno + 1
                    functions.append((f"{rel}:{node.name}", size))
    return {"folders": folders, "modules": modules, "classes": classes, "functions": functions}


def over(items, limit):
    return sorted((i for i in items if i[1] > limit), key=lambda i: -i[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    s = shape(Path(args.root))
    report = {
        "folders_over": over(s["folders"].items(), LIMITS["modules_per_folder"]),
        "modules_over": over(s["modules"], LIMITS["module"]),
        "classes_over": over(s["classes"], LIMITS["class"]),
        "functions_over": over(s["functions"], LIMITS["function"]),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for package in PACKAGES:
        print(f"\n{package}/")
        for key, label in (
            ("folders_over", "folders with more than 8 modules"),
            ("modules_over", "modules over 600 lines"),
            ("classes_over", "classes over 350 lines"),
            ("functions_over", "functions over 60 lines"),
        ):
            rows = [r for r in report[key] if r[0].startswith(package)]
            print(f"  {label}: {len(rows)}")
            for name, size in rows[:40]:
                print(f"    {size:5d}  {name}")


if __name__ == "__main__":
    main()
