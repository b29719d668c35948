"""Write UCI sets from a Debian package into benchmarks/data/: letter recognition, Shuttle and
Satellite (Statlog Landsat).

The data sets come from the package registry this project may use, not from the web: Debian's
``r-cran-mlbench`` ships them as R data files (``LetterRecognition.rda``, ``Shuttle.rda``,
``Satellite.rda``). This script downloads the package (``apt-get download``, no root needed),
unpacks it (``dpkg-deb -x``) in a temporary folder, reads each R data frame
(``harness.rdata``), checks it against UCI's description, and writes X and y in UCI's row
order, each to a temporary file renamed into place:

- ``letter-recognition.npz``: X (20,000 x 16, uint8), y the letters as 0-25;
- ``shuttle.npz``: X (58,000 x 9, int16), y the classes as 0-6 in UCI's numbering (1 = Rad
  Flow ... 7 = Bpv Open, less one); the first 43,500 rows are UCI's training file, the rest
  its test file;
- ``satellite.npz``: X (6,435 x 36, uint8), y 0-5 for UCI's classes 1, 2, 3, 4, 5 and 7
  (there is no class 6); the first 4,435 rows train, the last 2,000 test.

With ``--folder PATH`` it reads the ``.rda`` files already on disk (an installed package's
/usr/lib/R/site-library/mlbench/data/).

Usage: python benchmarks/prepare_uci.py [--folder PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import LETTERS_PATH, MLBENCH_PACKAGE, SATELLITE_PATH, SHUTTLE_PATH
from harness.rdata import data_frame, read_rdata

LETTER_FEATURES = (
    "x.box y.box width high onpix x.bar y.bar x2bar y2bar xybar x2ybr xy2br x.ege xegvy y.ege yegvx"
).split()  # UCI's column order
DATA_IN_PACKAGE = Path("usr/lib/R/site-library/mlbench/data")
# mlbench's names of Shuttle's classes, in UCI's numbering 1-7
SHUTTLE_CLASSES = ("Rad.Flow", "Fpv.Close", "Fpv.Open", "High", "Bypass", "Bpv.Close", "Bpv.Open")
SHUTTLE_TRAIN_COUNTS = (34108, 37, 132, 6748, 2458, 6, 11)  # UCI's description
# mlbench's names of Satellite's classes, in UCI's numbering 1, 2, 3, 4, 5, 7
SATELLITE_CLASSES = (
    "red soil",
    "cotton crop",
    "grey soil",
    "damp grey soil",
    "vegetation stubble",
    "very damp grey soil",
)
SATELLITE_TRAIN_COUNTS = (1072, 479, 961, 415, 470, 1038)  # UCI's description


def downloaded_folder(folder: Path) -> Path:
    """Download and unpack the Debian package in ``folder``; the folder of its data files."""
    subprocess.run(["apt-get", "download", MLBENCH_PACKAGE], cwd=folder, check=True)
    (package,) = folder.glob(f"{MLBENCH_PACKAGE}_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(package), str(folder / "root")], check=True)
    return folder / "root" / DATA_IN_PACKAGE


def letters_arrays(rda: Path) -> tuple[np.ndarray, np.ndarray]:
    """X (20000, 16) uint8 and y (20000,) int64 from the R data frame, checked against UCI's
    description: 20,000 rows, features 0-15, 26 letters (789 A's)."""
    columns = data_frame(read_rdata(rda)["LetterRecognition"])
    X = np.stack([columns[name] for name in LETTER_FEATURES], axis=1)
    y = np.array([ord(letter) - ord("A") for letter in columns["lettr"]], dtype=np.int64)
    if X.shape != (20000, 16) or X.min() < 0 or X.max() > 15 or np.any(X != np.round(X)):
        raise ValueError(f"{rda}: expected 20,000 x 16 integers in 0-15, got {X.shape}")
    if np.bincount(y, minlength=26)[0] != 789 or y.max() != 25:
        raise ValueError(f"{rda}: the letters' counts differ from UCI's (789 A's)")
    return X.astype(np.uint8), y


def coded(names: np.ndarray, classes: tuple[str, ...], rda: Path) -> np.ndarray:
    """(n,) int64: each name's index in ``classes``; an unknown name is an error."""
    unknown = sorted(set(names.tolist()) - set(classes))
    if unknown:
        raise ValueError(f"{rda}: class names {unknown} are not among {list(classes)}")
    return np.array([classes.index(name) for name in names.tolist()], dtype=np.int64)


def feature_matrix(columns: dict, names: list[str], rda: Path, dtype) -> np.ndarray:
    """(n, len(names)) of ``dtype``: the columns, checked to be integers that fit it."""
    X = np.stack([np.asarray(columns[name], dtype=np.float64) for name in names], axis=1)
    info = np.iinfo(dtype)
    if np.any(X != np.round(X)) or X.min() < info.min or X.max() > info.max:
        raise ValueError(f"{rda}: expected integers in {info.min}..{info.max}")
    return X.astype(dtype)


@dataclass(frozen=True)
class StatlogSet:
    """How one of mlbench's Statlog data frames is read and checked against UCI's
    description: its frame's name, feature and class columns, class names in UCI's order,
    the shape of all its rows, and the class counts of its first ``n_train`` (UCI's
    training file)."""

    frame: str
    features: tuple[str, ...]
    class_column: str
    classes: tuple[str, ...]
    shape: tuple[int, int]
    n_train: int
    train_counts: tuple[int, ...]
    dtype: type

    def arrays(self, rda: Path) -> tuple[np.ndarray, np.ndarray]:
        """X (rows, features) of ``dtype`` and y (rows,) int64, UCI's training rows first."""
        columns = data_frame(read_rdata(rda)[self.frame])
        X = feature_matrix(columns, list(self.features), rda, self.dtype)
        y = coded(np.asarray(columns[self.class_column]), self.classes, rda)
        counts = tuple(np.bincount(y[: self.n_train], minlength=len(self.classes)).tolist())
        if X.shape != self.shape or counts != self.train_counts:
            raise ValueError(
                f"{rda}: expected UCI's {self.shape} rows, training counts "
                f"{self.train_counts}; got {X.shape}, {counts}"
            )
        return X, y


SHUTTLE = StatlogSet(
    frame="Shuttle",
    features=tuple(f"V{j}" for j in range(1, 10)),
    class_column="Class",
    classes=SHUTTLE_CLASSES,
    shape=(58000, 9),
    n_train=43500,
    train_counts=SHUTTLE_TRAIN_COUNTS,
    dtype=np.int16,
)
SATELLITE = StatlogSet(
    frame="Satellite",
    features=tuple(f"x.{j}" for j in range(1, 37)),
    class_column="classes",
    classes=SATELLITE_CLASSES,
    shape=(6435, 36),
    n_train=4435,
    train_counts=SATELLITE_TRAIN_COUNTS,
    dtype=np.uint8,
)


def write(path: Path, X: np.ndarray, y: np.ndarray) -> None:
    """X and y into ``path`` (.npz) through a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial.npz")
    np.savez_compressed(partial, X=X, y=y)
    os.replace(partial, path)
    print(f"wrote {path} ({path.stat().st_size:,} bytes): X {X.shape}, y {y.shape}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, help="mlbench's data folder already on disk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or downloaded_folder(Path(tmp))
        sets = [
            (LETTERS_PATH, letters_arrays(folder / "LetterRecognition.rda")),
            (SHUTTLE_PATH, SHUTTLE.arrays(folder / "Shuttle.rda")),
            (SATELLITE_PATH, SATELLITE.arrays(folder / "Satellite.rda")),
        ]
    for path, (X, y) in sets:
        write(path, X, y)


if __name__ == "__main__":
    main()
