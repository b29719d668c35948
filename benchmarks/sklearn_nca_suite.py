"""scikit-learn's own NCA test file run against ``training.NCA``: how much of its behaviour
a user switching from ``sklearn.neighbors.NeighborhoodComponentsAnalysis`` keeps.

The installed ``sklearn/neighbors/tests/test_nca.py`` is copied to a temporary directory
with its import of NeighborhoodComponentsAnalysis replaced by a subclass of training.NCA
(named like scikit-learn's, so its messages and warnings read the same), then run with
pytest. ``--sklearn-space`` also sets ``standardize=False``: scikit-learn learns in the raw
input space, our default standardises first.

Usage: python benchmarks/sklearn_nca_suite.py [--sklearn-space] [-v]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import sklearn

ROOT = Path(__file__).resolve().parents[1]
IMPORT = "from sklearn.neighbors import NeighborhoodComponentsAnalysis"
SHIM = """from training import NCA as _OurNCA


class NeighborhoodComponentsAnalysis(_OurNCA):
    pass
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sklearn-space", action="store_true", help="standardize=False")
    args = parser.parse_args()
    source = Path(sklearn.__file__).parent / "neighbors" / "tests" / "test_nca.py"
    text = source.read_text()
    if IMPORT not in text:
        sys.exit(f"{source}: the import to replace was not found; scikit-learn changed it")
    shim = SHIM
    if args.sklearn_space:
        shim += '\nNeighborhoodComponentsAnalysis.__init__.__kwdefaults__["standardize"] = False\n'
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "test_sklearn_nca.py"
        target.write_text(text.replace(IMPORT, shim))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore",
                "-rfE",
                str(target),
            ],
            cwd=tmp,
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )
    lines = result.stdout.splitlines()
    print(f"scikit-learn {sklearn.__version__}: {source}")
    print(f"training.NCA, standardize={'False' if args.sklearn_space else 'True (default)'}")
    for line in lines:
        if re.match(r"^(FAILED|ERROR) ", line):
            print(" ", line[:160])
    print(lines[-1] if lines else result.stderr[-2000:])


if __name__ == "__main__":
    main()
