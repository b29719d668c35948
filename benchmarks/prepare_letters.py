"""Write benchmarks/data/letter-recognition.npz: UCI's letter recognition from a Debian package.

The data set comes from the package registry this project may use, not from the web: Debian's
``r-cran-mlbench`` ships it as ``LetterRecognition.rda``. This script downloads the package
(``apt-get download``, no root needed), unpacks it (``dpkg-deb -x``) in a temporary folder,
reads the R data frame (``harness.rdata``) and writes X (20,000 x 16, uint8) and y (letters as
0-25) in UCI's row order, to a temporary file renamed into place. With ``--rda PATH`` it reads
an ``LetterRecognition.rda`` already on disk (an installed package's
/usr/lib/R/site-library/mlbench/data/).

Usage: python benchmarks/prepare_letters.py [--rda PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import LETTERS_PACKAGE, LETTERS_PATH
from harness.rdata import data_frame, read_rdata

FEATURES = (
    "x.box y.box width high onpix x.bar y.bar x2bar y2bar xybar x2ybr xy2br x.ege xegvy y.ege yegvx"
).split()  # UCI's column order
RDA_IN_PACKAGE = Path("usr/lib/R/site-library/mlbench/data/LetterRecognition.rda")


def downloaded_rda(folder: Path) -> Path:
    """Download and unpack the Debian package in ``folder``; the path of its letters file."""
    subprocess.run(["apt-get", "download", LETTERS_PACKAGE], cwd=folder, check=True)
    (package,) = folder.glob(f"{LETTERS_PACKAGE}_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(package), str(folder / "root")], check=True)
    return folder / "root" / RDA_IN_PACKAGE


def letters_arrays(rda: Path) -> tuple[np.ndarray, np.ndarray]:
    """X (20000, 16) uint8 and y (20000,) int64 from the R data frame, checked against UCI's
    description: 20,000 rows, features 0-15, 26 letters (789 A's)."""
    columns = data_frame(read_rdata(rda)["LetterRecognition"])
    X = np.stack([columns[name] for name in FEATURES], axis=1)
    y = np.array([ord(letter) - ord("A") for letter in columns["lettr"]], dtype=np.int64)
    if X.shape != (20000, 16) or X.min() < 0 or X.max() > 15 or np.any(X != np.round(X)):
        raise ValueError(f"{rda}: expected 20,000 x 16 integers in 0-15, got {X.shape}")
    if np.bincount(y, minlength=26)[0] != 789 or y.max() != 25:
        raise ValueError(f"{rda}: the letters' counts differ from UCI's (789 A's)")
    return X.astype(np.uint8), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rda", type=Path, help="a LetterRecognition.rda already on disk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rda = args.rda or downloaded_rda(Path(folder))
        X, y = letters_arrays(rda)
    LETTERS_PATH.parent.mkdir(parents=True, exist_ok=True)
    partial = LETTERS_PATH.with_suffix(f".{os.getpid()}.partial.npz")
    np.savez_compressed(partial, X=X, y=y)
    os.replace(partial, LETTERS_PATH)
    print(f"wrote {LETTERS_PATH} ({LETTERS_PATH.stat().st_size:,} bytes): X {X.shape}, y {y.shape}")


if __name__ == "__main__":
    main()
