"""A corpus of malformed inputs for the training job's readers (issue 57, target 4): each
row lays out files, runs ``python -m training`` (a fork of a preloaded process: the
``python_m_training`` fixture) and expects exit status 2 with one line on stderr holding the
given words, never a traceback, and nothing written at ``--out``. Rows that hold arrays go
through ``NCA.fit`` too, which raises a ``ValueError`` with the same words (scikit-learn's
convention). The references commands' id readers have their own rows."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.training.conftest import refused_in_one_line
from training import NCA

RNG = np.random.default_rng(0)
X_OK = RNG.normal(size=(60, 4))
Y_OK = np.arange(60) % 3


def npz_arrays(d: Path, X, y) -> list[str]:
    np.savez(d / "data.npz", X=X, y=y)
    return ["--data", d / "data.npz"]


def npy_pair(d: Path, X, y) -> list[str]:
    np.save(d / "X.npy", X)
    np.save(d / "y.npy", y)
    return ["--data", d / "X.npy", "--labels", d / "y.npy"]


def csv_file(d: Path, text: str, encoding: str = "utf-8") -> list[str]:
    (d / "data.csv").write_bytes(text.encode(encoding))
    return ["--data", d / "data.csv"]


def csv_rows(header: bool = True, bom: bool = False) -> str:
    lines = ["label,a,b,c,d"] if header else []
    lines += [f"{y},{','.join(f'{v:.3f}' for v in x)}" for x, y in zip(X_OK, Y_OK, strict=True)]
    return ("\ufeff" if bom else "") + "\n".join(lines) + "\n"


def with_value(value: float, at=(5, 2)) -> np.ndarray:
    X = X_OK.copy()
    X[at] = value
    return X


def text_named_npy(d: Path) -> list[str]:
    """Features written as text under a .npy name (numpy would try to unpickle it)."""
    args = npy_pair(d, X_OK, Y_OK)
    (d / "X.npy").write_text("1,2,3\n")
    return args


def huge_npy_header(d: Path) -> list[str]:
    """A .npy whose honest header is padded to 60,000 bytes, over numpy's 10,000-byte limit
    (numpy's refusal ran over three lines and advised allow_pickle=True)."""
    args = npy_pair(d, X_OK, Y_OK)
    text = repr({"descr": "<f8", "fortran_order": False, "shape": X_OK.shape}).encode()
    text = text + b" " * (60_000 - 12 - len(text) - 1) + b"\n"
    header = b"\x93NUMPY\x02\x00" + len(text).to_bytes(4, "little") + text
    (d / "X.npy").write_bytes(header + X_OK.astype("<f8").tobytes())
    return args


def latin1_past_a_megabyte(d: Path) -> list[str]:
    """A CSV whose one latin-1 byte (é) lies at byte 8 + 4 * 300,000 + 5, far past the first
    chunk a reader decodes."""
    (d / "big.csv").write_bytes(b"label,a\n" + b"1,2\n" * 300_000 + b"2,caf\xe9\n")
    return ["--data", d / "big.csv"]


def truncated_npz(d: Path) -> list[str]:
    np.savez(d / "data.npz", X=X_OK, y=Y_OK)
    data = (d / "data.npz").read_bytes()
    (d / "data.npz").write_bytes(data[: len(data) // 2])
    return ["--data", d / "data.npz"]


def npz_without_y(d: Path) -> list[str]:
    np.savez(d / "data.npz", X=X_OK)
    return ["--data", d / "data.npz"]


def pickled_npy(d: Path) -> list[str]:
    np.save(d / "X.npy", np.array([{"a": 1}] * 60, dtype=object), allow_pickle=True)
    np.save(d / "y.npy", Y_OK)
    return ["--data", d / "X.npy", "--labels", d / "y.npy"]


def not_a_zip(d: Path) -> list[str]:
    (d / "data.npz").write_bytes(b"this is not a zip archive")
    return ["--data", d / "data.npz"]


def npz_claiming(
    d: Path, shape: tuple, y: np.ndarray, descr: str = "<f8", version=(1, 0), member="X.npy"
) -> list[str]:
    """An .npz whose X member's header states ``shape`` (of ``descr``) over a few bytes of
    values: what a small compressed file expanding to terabytes looks like before it is
    read; y is whole."""
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    with zipfile.ZipFile(d / "data.npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open(member, "w") as stream:
            write_npy_header(stream, header, version)
            stream.write(bytes(64))
        with archive.open("y.npy", "w") as stream:
            np.lib.format.write_array(stream, y)
    return ["--data", d / "data.npz"]


def write_npy_header(stream, header: dict, version: tuple) -> None:
    """An .npy header of format ``version`` (1.0, 2.0 or 3.0), as the format's NEP lays it."""
    prefix = 10 if version == (1, 0) else 12
    text = repr(header)
    text += " " * (-(prefix + len(text) + 1) % 64) + "\n"
    data = text.encode("utf-8" if version == (3, 0) else "latin1")
    width = 2 if version == (1, 0) else 4
    stream.write(b"\x93NUMPY" + bytes(version) + len(data).to_bytes(width, "little") + data)


def npz_claiming_labels(d: Path) -> list[str]:
    """An .npz whose y member states 10^9 labels over a few bytes."""
    with zipfile.ZipFile(d / "data.npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("X.npy", "w") as stream:
            np.lib.format.write_array(stream, X_OK)
        with archive.open("y.npy", "w") as stream:
            header = {"descr": "<i8", "fortran_order": False, "shape": (10**9,)}
            np.lib.format.write_array_header_1_0(stream, header)
            stream.write(bytes(64))
    return ["--data", d / "data.npz", "--memory-budget-gib", "0.01"]


def npz_without_suffixes(d: Path) -> list[str]:
    """An .npz whose members are named X and y (np.load lists them; np.savez adds .npy)."""
    with zipfile.ZipFile(d / "data.npz", "w") as archive:
        for name, array in (("X", X_OK), ("y", np.zeros(60, dtype=np.int64))):
            with archive.open(name, "w") as stream:
                np.lib.format.write_array(stream, array)
    return ["--data", d / "data.npz"]


def zip_of_text(d: Path) -> list[str]:
    with zipfile.ZipFile(d / "data.npz", "w") as archive:
        archive.writestr("X.npy", "not an array")
        archive.writestr("y.npy", "not an array")
    return ["--data", d / "data.npz"]


def parquet_file(d: Path, columns: dict, **table_kwargs) -> list[str]:
    """A Parquet file of the given columns (name -> pyarrow array or list of values)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({name: values for name, values in columns.items()}, **table_kwargs)
    pq.write_table(table, d / "data.parquet")
    return ["--data", d / "data.parquet"]


def parquet_wide(**changes) -> dict:
    """The wide layout of X_OK and Y_OK as Parquet columns, with ``changes`` applied."""
    columns = {f"f{j}": X_OK[:, j].tolist() for j in range(X_OK.shape[1])}
    columns["label"] = Y_OK.tolist()
    columns.update(changes)
    return columns


def parquet_lists(rows: list) -> dict:
    import pyarrow as pa

    return {"pixels": pa.array(rows, type=pa.list_(pa.float32())), "label": Y_OK.tolist()}


def truncated_parquet(d: Path) -> list[str]:
    args = parquet_file(d, parquet_wide())
    data = (d / "data.parquet").read_bytes()
    (d / "data.parquet").write_bytes(data[: len(data) // 2])
    return args


def text_named_parquet(d: Path) -> list[str]:
    (d / "data.parquet").write_text("label,a\n1,2\n")
    return ["--data", d / "data.parquet"]


def parquet_of(kind: str):
    """A wide Parquet file whose column f1 holds values of ``kind``."""
    import pyarrow as pa

    values = {
        "text": pa.array([str(v) for v in X_OK[:, 1]]),
        "bool": pa.array([bool(v > 0) for v in X_OK[:, 1]]),
        "timestamp": pa.array(np.arange(60).astype("datetime64[s]")),
        "struct": pa.array([{"a": float(v)} for v in X_OK[:, 1]]),
    }[kind]
    return lambda d: parquet_file(d, parquet_wide(f1=values))


def pa_uint64(values: list):
    import pyarrow as pa

    return pa.array(values, type=pa.uint64())


def pa_empty(kind: str = "float64"):
    import pyarrow as pa

    return pa.array([], type=getattr(pa, kind)())


def with_null(values: list, at: int = 3) -> list:
    return [None if i == at else v for i, v in enumerate(values)]


# (name, lay out the files -> CLI arguments, words of the one error line, arrays for NCA.fit)
CORPUS = [
    (  # the estimator names the row and column too (was scikit-learn's lines without them)
        "NaN in X",
        lambda d: npy_pair(d, with_value(np.nan), Y_OK),
        "NaN or Inf (first at row 5, column 2)",
        (with_value(np.nan), Y_OK),
    ),
    (
        "Inf in X",
        lambda d: npy_pair(d, with_value(np.inf), Y_OK),
        "NaN or Inf (first at row 5, column 2)",
        (with_value(np.inf), Y_OK),
    ),
    (
        "a value beyond float32 (1e39)",
        lambda d: npy_pair(d, with_value(1e39), Y_OK),
        "beyond float32's range",
        (with_value(1e39), Y_OK),
    ),
    (
        "a value beyond float32 (-1e300)",
        lambda d: npy_pair(d, with_value(-1e300, at=(0, 0)), Y_OK),
        "row 0, column 0 is beyond float32's range",
        (with_value(-1e300, at=(0, 0)), Y_OK),
    ),
    (
        "every value beyond float32",
        lambda d: npy_pair(d, np.full((60, 4), 1e300), Y_OK),
        "beyond float32's range",
        (np.full((60, 4), 1e300), Y_OK),
    ),
    (
        "labels shorter than X",
        lambda d: npy_pair(d, X_OK, Y_OK[:50]),
        "has 60 rows but its labels have 50",
        None,
    ),
    ("1-D X", lambda d: npy_pair(d, X_OK[:, 0], Y_OK), "2-D", None),
    (
        "2-D labels",
        lambda d: npy_pair(d, X_OK, Y_OK[:, None]),
        "y.npy: labels: expected a 1-D",
        None,
    ),
    (
        "complex labels",
        lambda d: npy_pair(d, X_OK, Y_OK.astype(np.complex64)),
        "y.npy: labels: must be integers or strings, got dtype complex64",
        None,
    ),
    (
        "non-integer float labels",
        lambda d: npy_pair(d, X_OK, Y_OK + 0.5),
        "y.npy: labels: must be integers or strings, got non-integer floats (first at row 0: 0.5)",
        None,
    ),
    (
        "a NaN label",
        lambda d: npy_pair(d, X_OK, np.where(np.arange(60) == 3, np.nan, Y_OK.astype(float))),
        "y.npy: labels: must be integers or strings, got non-integer floats (first at row 3: nan)",
        None,
    ),
    ("string features", lambda d: npy_pair(d, X_OK.astype(str), Y_OK), "numeric", None),
    ("a pickled object array", pickled_npy, "", None),
    ("a truncated .npz", truncated_npz, "", None),
    ("an .npz without y", npz_without_y, "", None),
    ("an .npz that is not a zip", not_a_zip, "", None),
    ("an .npz of text members", zip_of_text, "", None),
    (
        "an .npz claiming 8 TB of X, its labels one class",
        lambda d: [
            *npz_claiming(d, (10**7, 10**5), np.zeros(10**7 // 10**4, dtype=np.int64)),
            "--memory-budget-gib",
            "100000",  # the budget lets it through: the labels refuse it, X never read
        ],
        "labels: need at least 2 classes, found 1 ([0])",
        None,
    ),
    (
        "an .npz claiming 8 TB of X, its labels fine",
        lambda d: npz_claiming(d, (1000, 10**9), np.arange(1000) % 2),
        "X: 1000 x 1000000000 values take 7,450.6 GiB as float64, over the memory budget",
        None,
    ),
    (
        "an .npz claiming 8 TB of X in a version 3.0 header",
        lambda d: npz_claiming(d, (1000, 10**9), np.arange(1000) % 2, version=(3, 0)),
        "X: 1000 x 1000000000 values take 7,450.6 GiB as float64, over the memory budget",
        None,
    ),
    (
        "an .npz claiming 40 values of 20 MB each",
        lambda d: npz_claiming(d, (40, 1), np.arange(40) % 2, descr="|V20000000"),
        "X: features must be numeric, got dtype |V20000000",
        None,
    ),
    (
        "an .npz claiming 10^9 labels",
        npz_claiming_labels,
        "y: 1000000000 values take 7.5 GiB as float64, over the memory budget of 10.2 MiB",
        None,
    ),
    (
        "an .npz of members without the .npy suffix, one class",
        npz_without_suffixes,
        "labels: need at least 2 classes",
        None,
    ),
    (
        "an .npz of bool labels",
        lambda d: npz_arrays(d, X_OK, Y_OK % 2 == 0),
        "labels: must be integers or strings, got booleans",
        None,
    ),
    (
        "--memory-budget-gib 1e-300",
        lambda d: [*npy_pair(d, X_OK, Y_OK), "--memory-budget-gib", "1e-300"],
        "must be a finite number of GiB, at least 2^-20",
        None,
    ),
    (
        "an .npz over a stated budget",
        lambda d: [
            *npz_arrays(d, RNG.normal(size=(1000, 200)), np.arange(1000) % 2),
            "--memory-budget-gib",
            "0.001",
        ],
        "X: 1000 x 200 values take 1.5 MiB as float64, over the memory budget of 1.0 MiB",
        None,
    ),
    (
        "a .npy over a stated budget",
        lambda d: [
            *npy_pair(d, RNG.normal(size=(1000, 200)), np.arange(1000) % 2),
            "--memory-budget-gib",
            "0.001",
        ],
        "features: 1000 x 200 values take",
        None,
    ),
    (
        "a .npy pair whose labels are one class",
        lambda d: npy_pair(d, X_OK, np.zeros(60, dtype=np.int64)),
        "y.npy: labels: need at least 2 classes",
        None,
    ),
    (
        "a Parquet file over a stated budget",
        lambda d: [*parquet_file(d, parquet_wide()), "--memory-budget-gib", "1e-6"],
        "features: 60 x 4 values take",
        None,
    ),
    (
        "a Parquet file over a budget, its features named label.*",
        lambda d: [
            *parquet_file(
                d, {**{f"label.f{j}": X_OK[:, j].tolist() for j in range(4)}, "label": Y_OK}
            ),
            "--memory-budget-gib",
            "1e-6",
        ],
        "features: 60 x 4 values take",
        None,
    ),
    (
        "--labels an .npz",
        lambda d: [*npy_pair(d, X_OK, Y_OK)[:3], npz_arrays(d, X_OK, Y_OK)[1]],
        "expected a .npy file of labels",
        None,
    ),
    (
        "--memory-budget-gib 0",
        lambda d: [*npy_pair(d, X_OK, Y_OK), "--memory-budget-gib", "0"],
        "--memory-budget-gib=0.0 must be a finite number of GiB, at least 2^-20",
        None,
    ),
    ("an empty CSV", lambda d: csv_file(d, ""), "empty CSV", None),
    ("a CSV of a header alone", lambda d: csv_file(d, "label,a,b\n"), "a header and no rows", None),
    (
        "a CSV with an empty label",
        lambda d: csv_file(d, "label,a\n1,2\n,3\n2,4\n"),
        "data.csv: the label of data row 2 is empty",
        None,
    ),
    (
        "a CSV label beyond int64",
        lambda d: csv_file(d, "label,a\n9223372036854775808,2\n1,3\n1,4\n"),
        "the label 9223372036854775808 of data row 1 is beyond the 64-bit integer range",
        None,
    ),
    (
        # refused from its rows and columns, before a value is parsed (the bad last value
        # is never reached)
        "a CSV over the memory budget",
        lambda d: [
            *csv_file(d, "label,a,b\n" + "1,2,3\n" * 200 + "2,x,3\n"),
            "--memory-budget-gib",
            str(2**-20),
        ],
        "data.csv: features: 201 x 2 values take",
        None,
    ),
    (
        "a CSV row with a missing field",
        lambda d: csv_file(d, "label,a,b\n1,2,3\n2,3\n"),
        "fields",
        None,
    ),
    (
        "a CSV with a text feature",
        lambda d: csv_file(d, "label,a\n1,2\n2,x\n"),
        "data row 2, column 'a': 'x' is not a number",
        None,
    ),
    (
        "a CSV feature with an underscore",
        lambda d: csv_file(d, "label,a,b\n1,2,3\n2,1_000,4\n"),
        "data row 2, column 'a': '1_000' is not a number",
        None,
    ),
    (
        "a CSV feature of Arabic-Indic digits",
        lambda d: csv_file(d, "label,a,b\n1,2,3\n2,\u0661,4\n"),
        "data row 2, column 'a': '\u0661' is not a number",
        None,
    ),
    (
        "a CSV header naming a column twice",
        lambda d: csv_file(d, "label,a,a\n1,2,3\n2,3,4\n"),
        "header names ['a'] appear more than once",
        None,
    ),
    (
        "--labels beside an .npz",
        lambda d: [*npz_arrays(d, X_OK, Y_OK), "--labels", d / "y.npy"],
        "--labels applies to a .npy feature file",
        None,
    ),
    (
        "--label-column beside a .npy",
        lambda d: [*npy_pair(d, X_OK, Y_OK), "--label-column", "label"],
        "--label-column applies to a CSV or Parquet file",
        None,
    ),
    (
        "a text file named .npy",
        text_named_npy,
        "not a .npy file (it does not start with .npy's magic bytes)",
        None,
    ),
    (
        "a .npy header of 60,000 bytes",
        huge_npy_header,
        "its header is over numpy's limit of 10,000 bytes",
        None,
    ),
    (
        "a latin-1 byte past the first megabyte of a CSV",
        latin1_past_a_megabyte,
        f"not UTF-8 text (byte {8 + 4 * 300_000 + 5}",
        None,
    ),
    (
        "a CSV without the named label column",
        lambda d: [*csv_file(d, csv_rows()), "--label-column", "target"],
        "no label column 'target'",
        None,
    ),
    (
        "a CSV value beyond float32",
        lambda d: csv_file(d, "label,a,b\n0,1,2\n1,1e39,2\n0,3,1\n1,2,2\n"),
        "beyond float32's range",
        None,
    ),
    ("--data a directory", lambda d: ["--data", d], "", None),
    (
        "--data a directory named .npy",
        lambda d: (d / "X.npy").mkdir() or ["--data", d / "X.npy", "--labels", d / "y.npy"],
        "is a directory; expected a data file",
        None,
    ),
    (
        "--data a FIFO",
        lambda d: os.mkfifo(d / "X.csv") or ["--data", d / "X.csv"],
        "is not a regular file",
        None,
    ),
    (
        "--data a device",
        lambda d: (d / "X.csv").symlink_to("/dev/null") or ["--data", d / "X.csv"],
        "is not a regular file",
        None,
    ),
    ("--data missing", lambda d: ["--data", d / "missing.npy"], "missing.npy", None),
    (
        "a latin-1 CSV",
        lambda d: csv_file(d, "label,caf\u00e9\n1,2\n2,3\n", encoding="latin-1"),
        "not UTF-8 text",
        None,
    ),
    ("a UTF-16 CSV", lambda d: csv_file(d, csv_rows(), encoding="utf-16"), "not UTF-8 text", None),
    (
        "a CSV field of 200,000 characters",
        lambda d: csv_file(d, "label,a\n1," + "9" * 200_000 + "\n"),
        "not a readable CSV file",
        None,
    ),
    (
        "--labels a directory",
        lambda d: (d / "y.npy").mkdir() or npy_pair_x_only(d),
        "--labels",
        None,
    ),
    ("--seed -1", lambda d: [*npy_pair(d, X_OK, Y_OK), "--seed", "-1"], "--seed=-1", None),
    (
        "--seed 2^32",
        lambda d: [*npy_pair(d, X_OK, Y_OK), "--seed", str(2**32)],
        "must be an integer in [0, 4294967295]",
        None,
    ),
    (
        "a truncated Parquet file",
        truncated_parquet,
        "not a readable Parquet file",
        None,
    ),
    (
        "a text file named .parquet",
        text_named_parquet,
        "not a readable Parquet file",
        None,
    ),
    ("a Parquet text feature", parquet_of("text"), "'f1' has type string; expected numbers", None),
    ("a Parquet bool feature", parquet_of("bool"), "'f1' has type bool; expected numbers", None),
    ("a Parquet timestamp feature", parquet_of("timestamp"), "'f1' has type timestamp", None),
    ("a Parquet struct feature", parquet_of("struct"), "'f1' has type struct", None),
    (
        "a Parquet null feature",
        lambda d: parquet_file(d, parquet_wide(f2=with_null(X_OK[:, 2].tolist()))),
        "feature column 'f2' has 1 nulls",
        None,
    ),
    (
        "a Parquet null label",
        lambda d: parquet_file(d, parquet_wide(label=with_null(Y_OK.tolist()))),
        "label column 'label' has 1 nulls",
        None,
    ),
    (
        "Parquet float labels",
        lambda d: parquet_file(d, parquet_wide(label=(Y_OK + 0.5).tolist())),
        "label column 'label' has type double; expected integers or strings",
        None,
    ),
    (
        "a Parquet NaN feature",
        lambda d: parquet_file(d, parquet_wide(f2=with_value(np.nan)[:, 2].tolist())),
        "NaN or Inf",
        None,
    ),
    (
        "a Parquet value beyond float32",
        lambda d: parquet_file(d, parquet_wide(f2=with_value(1e39)[:, 2].tolist())),
        "beyond float32's range",
        None,
    ),
    (
        "Parquet lists of different lengths",
        lambda d: parquet_file(d, parquet_lists([[1.0, 2.0]] * 59 + [[1.0]])),
        "lists of different lengths (row 0 has 2, row 59 has 1)",
        None,
    ),
    (
        "Parquet empty lists",
        lambda d: parquet_file(d, parquet_lists([[]] * 60)),
        "holds empty lists",
        None,
    ),
    (
        "a Parquet list holding a null",
        lambda d: parquet_file(d, parquet_lists([[1.0, None]] + [[1.0, 2.0]] * 59)),
        "null values in its lists",
        None,
    ),
    (
        "a Parquet null list",
        lambda d: parquet_file(d, parquet_lists([None] + [[1.0, 2.0]] * 59)),
        "has 1 null rows",
        None,
    ),
    (
        "a Parquet file without the named label column",
        lambda d: [*parquet_file(d, parquet_wide()), "--label-column", "target"],
        "no label column 'target'",
        None,
    ),
    (
        "a Parquet file of the label column alone",
        lambda d: parquet_file(d, {"label": Y_OK.tolist()}),
        "no feature columns beside the label column 'label'",
        None,
    ),
    (
        "Parquet uint64 labels beyond int64",
        lambda d: parquet_file(d, parquet_wide(label=pa_uint64([2**63 + int(v) for v in Y_OK]))),
        "holds 9223372036854775810, beyond int64's range",
        None,
    ),
    (
        "a Parquet file of no rows",
        lambda d: parquet_file(d, {"f0": pa_empty(), "label": pa_empty("int64")}),
        "",
        None,
    ),
    # a read error names the file (EIO, as a failing disk gives: /proc/self/mem read at
    # offset 0, which no process maps; it was a bare "Input/output error (EIO)")
    ("a .npy whose read fails", lambda d: failing_read(d, "X.npy"), "X.npy: Input/output", None),
    ("a CSV whose read fails", lambda d: failing_read(d, "X.csv"), "X.csv: Input/output", None),
]


def failing_read(d: Path, name: str) -> list[str]:
    (d / name).symlink_to("/proc/self/mem")
    if name.endswith(".csv"):
        return ["--data", d / name]
    np.save(d / "y.npy", Y_OK)
    return ["--data", d / name, "--labels", d / "y.npy"]


def npy_pair_x_only(d: Path) -> list[str]:
    np.save(d / "X.npy", X_OK)
    return ["--data", d / "X.npy", "--labels", d / "y.npy"]


@pytest.mark.parametrize("name, lay_out, words, arrays", CORPUS, ids=[c[0] for c in CORPUS])
def test_the_job_refuses_in_one_line(python_m_training, tmp_path, name, lay_out, words, arrays):
    line = refused_in_one_line(python_m_training, tmp_path, lay_out)
    assert words in line, line
    if arrays is not None:  # the estimator says the same
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            NCA(n_components=2, max_iter=2).fit(*arrays)


def test_a_csv_with_a_byte_order_mark_reads_its_header(python_m_training, tmp_path):
    """A spreadsheet's "CSV UTF-8" starts with a byte-order mark: the label column is still
    'label' (before: the mark made it '\\ufefflabel', and the last column was trained on as
    the label, two classes instead of three)."""
    from training.data.datasets import load_dataset

    data = tmp_path / "data.csv"
    data.write_text(csv_rows(bom=True), encoding="utf-8")
    dataset = load_dataset(str(data))
    assert dataset.feature_names == ["a", "b", "c", "d"]
    np.testing.assert_array_equal(dataset.y, Y_OK)
    headless = tmp_path / "headless.csv"
    headless.write_text(csv_rows(header=False, bom=True), encoding="utf-8")
    dataset = load_dataset(str(headless), label_column="0")
    np.testing.assert_array_equal(dataset.y, Y_OK)


def test_references_condense_refuses_a_negative_seed_in_one_line(
    python_m_training, digits_like_model, tmp_path
):
    model, _ = digits_like_model
    out = tmp_path / "out"
    code, _, stderr = python_m_training(
        "references", "condense", "--model", model, "--seed", "-1", "--out", out
    )
    assert code == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip() == "error: --seed=-1 must be an integer in [0, 4294967295]"
    assert not out.exists()


def assert_remove_refuses(python_m_training, model, tmp_path, args: list, words: str) -> None:
    """``references remove --model MODEL ARGS --out OUT``: exit 2, one line holding
    ``words``, no traceback, nothing at OUT."""
    out = tmp_path / "out"
    code, _, stderr = python_m_training(
        "references", "remove", "--model", model, *args, "--out", out
    )
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and words in lines[0], lines
    assert not out.exists()


IDS_CORPUS = [
    ("beyond int64", ["--ids", "9223372036854775808"], "beyond the 64-bit integer range"),
    ("below int64", ["--ids", "-9223372036854775809"], "beyond the 64-bit integer range"),
    ("not an integer", ["--ids", "12x"], "ids must be integers, got '12x'"),
    ("a float", ["--ids", "1.5"], "ids must be integers, got '1.5'"),
    ("digits with an underscore", ["--ids", "1_0"], "ids must be integers, got '1_0'"),
    ("another script's digits", ["--ids", "\u0663"], "ids must be integers"),
]


def _ids_npy(array):
    def lay_out(d: Path) -> list:
        np.save(d / "ids.npy", array)
        return ["--ids-file", d / "ids.npy"]

    return lay_out


def _ids_text(data: bytes):
    def lay_out(d: Path) -> list:
        (d / "ids.txt").write_bytes(data)
        return ["--ids-file", d / "ids.txt"]

    return lay_out


def _ids_failing_read(d: Path) -> list:
    (d / "ids.txt").symlink_to("/proc/self/mem")  # read at offset 0: EIO, naming no file
    return ["--ids-file", d / "ids.txt"]


IDS_FILE_CORPUS = [
    ("a 2-D .npy", _ids_npy(np.zeros((2, 2), np.int64)), "expected a 1-D array of ids"),
    ("a 0-D .npy", _ids_npy(np.int64(3)), "expected a 1-D array of ids"),
    ("a float .npy", _ids_npy(np.array([1.0, 2.0])), "ids must be integers, got dtype float64"),
    ("uint64 beyond int64", _ids_npy(np.array([2**63 + 5], np.uint64)), "beyond the 64-bit"),
    ("latin-1 text", _ids_text("1\n\u00e9\n".encode("latin-1")), "not UTF-8 text"),
    ("a text file whose read fails", _ids_failing_read, "ids.txt': cannot be read (Input/output"),
]


@pytest.mark.parametrize(
    "name, lay_out, words", IDS_FILE_CORPUS, ids=[c[0] for c in IDS_FILE_CORPUS]
)
def test_references_remove_refuses_bad_ids_files_in_one_line(
    python_m_training, digits_like_model, tmp_path, name, lay_out, words
):
    assert_remove_refuses(
        python_m_training, digits_like_model[0], tmp_path, lay_out(tmp_path), words
    )


def test_an_ids_file_of_small_uint64_or_with_a_byte_order_mark_is_read(digits_like_model, tmp_path):
    from training.references.cli import _ids_file

    np.save(tmp_path / "ids.npy", np.array([1, 2], np.uint64))
    assert _ids_file(str(tmp_path / "ids.npy")).tolist() == [1, 2]
    (tmp_path / "ids.txt").write_text("\ufeff7\n8\n", encoding="utf-8")
    assert _ids_file(str(tmp_path / "ids.txt")).tolist() == [7, 8]


@pytest.mark.parametrize("name, args, words", IDS_CORPUS, ids=[c[0] for c in IDS_CORPUS])
def test_references_remove_refuses_bad_ids_in_one_line(
    python_m_training, digits_like_model, tmp_path, name, args, words
):
    assert_remove_refuses(python_m_training, digits_like_model[0], tmp_path, args, words)


def test_an_ids_file_beyond_int64_is_refused_in_one_line(
    python_m_training, digits_like_model, tmp_path
):
    model, _ = digits_like_model
    ids = tmp_path / "ids.txt"
    ids.write_text("1\n2\n99999999999999999999\n")
    code, _, stderr = python_m_training(
        "references", "remove", "--model", model, "--ids-file", ids, "--out", tmp_path / "o"
    )
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "99999999999999999999 is beyond the 64-bit integer range" in stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--memory-budget-gib", "abc"], "argument --memory-budget-gib: invalid float value"),
        (["--max-iter"], "argument --max-iter: expected one argument"),
        (["references", "add", "--model"], "references add: argument --model: expected one"),
        (["references", "remove", "--model", "m"], "the following arguments are required"),
        (["references", "bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_option(python_m_training, args, words):
    code, stdout, stderr = python_m_training(*args)
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and stderr.startswith("error: python -m training"), stderr
    assert words in stderr and "--help lists the options" in stderr


def test_csv_labels_written_as_integer_decimals_are_the_same_classes(tmp_path):
    """ "1" and "1.0" in a CSV's label column are one class (as integer-valued float labels
    of an .npy are); labels that are not all integers stay strings."""
    from training.data.datasets import load_dataset

    path = tmp_path / "mixed.csv"
    path.write_text("label,a\n0,1\n0.0,2\n1,3\n1.0,4\n2,5\n2.00,6\n")
    assert load_dataset(path).y.tolist() == [0, 0, 1, 1, 2, 2]
    path.write_text("label,a\ncat,1\n1,2\n")
    assert load_dataset(path).y.tolist() == ["cat", "1"]


def test_an_empty_out_is_refused_before_the_data_is_read(python_m_training, tmp_path):
    """--out "" is a path mistyped, not a request for the default models/<data>: refused in
    one line before the data is read (the data here is not even there)."""
    args = ["--data", tmp_path / "absent.npy", "--labels", tmp_path / "absent_y.npy"]
    code, _, stderr = python_m_training(*args, "--out", "", "--quiet", "--max-iter", "2")
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "--out '': expected a directory path" in stderr


OPTION_VALUES = [  # (options, the refusal's words): each before the data is read
    (["--max-iter", "-1"], "--max-iter=-1 must be an integer >= 1"),
    (["--k", "0"], "--k=0 must be an integer >= 1"),
    (["--objective", "bogus"], "--objective='bogus' must be one of"),
    (["--tol", "-1"], "--tol=-1.0 must be a finite real number >= 0"),
    (["--solver", "newton"], "--solver='newton' must be one of ('auto', 'lbfgs', 'adam')"),
    (["--n-components", "0"], "--n-components=0 must be an integer >= 1"),
    (["--init", "bogus"], "--init='bogus' must be one of"),
    (["--device", "bogus"], "--device='bogus' is not a valid torch device"),
]


@pytest.mark.parametrize("options, words", OPTION_VALUES, ids=[o[0] for o, _ in OPTION_VALUES])
def test_an_option_value_is_refused_before_the_data_is_read(
    python_m_training, tmp_path, options, words
):
    """The estimator's table checks each option's value first: the data named here is not
    there, so a refusal that names the option came before the read (it used to come after
    the read and name the setting, max_iter=-1)."""
    args = ["--data", tmp_path / "absent.npy", "--labels", tmp_path / "absent_y.npy", *options]
    code, _, stderr = python_m_training(*args, "--out", tmp_path / "out", "--quiet")
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert words in stderr and "absent" not in stderr, stderr


def test_n_components_above_the_datas_features_names_the_option_before_the_fit(
    python_m_training, tmp_path
):
    args = [*npy_pair(tmp_path, X_OK, Y_OK), "--n-components", "99", "--quiet"]
    code, _, stderr = python_m_training(*args, "--out", tmp_path / "out")
    assert code == 2 and stderr.count("\n") == 1, stderr
    d = X_OK.shape[1]
    assert f"--n-components=99 must be at most the data's number of features, D = {d}" in stderr


@pytest.mark.parametrize(
    "column, label_of_first_row",
    [("-1", 0), ("label", 0), ("2", 0), ("0", 1), ("-3", 1), ("a", 1)],
)
def test_a_csv_label_column_is_a_name_or_a_position(tmp_path, column, label_of_first_row):
    """--label-column names a header column, or counts positions (0 the first, -1 the
    last); -1 used to switch a file with a header to headerless reading and fail."""
    from training.data.datasets import load_dataset

    path = tmp_path / "t.csv"
    path.write_text("a,b,label\n1,2,0\n3,4,1\n")
    data = load_dataset(path, label_column=column)
    assert data.y.tolist()[0] == label_of_first_row and data.X.shape == (2, 2)


@pytest.mark.parametrize("column", ["3", "-4"])
def test_a_csv_label_column_position_outside_the_file_is_refused(tmp_path, column):
    from training.data.datasets import DataError, load_dataset

    path = tmp_path / "t.csv"
    path.write_text("a,b,label\n1,2,0\n3,4,1\n")
    with pytest.raises(DataError, match=f"--label-column {column}: no column at that position"):
        load_dataset(path, label_column=column)


@pytest.mark.parametrize("command", [["references", "add"], ["report", "m"]])
def test_training_options_before_a_command_are_refused_not_ignored(python_m_training, command):
    code, _, stderr = python_m_training("--max-iter", "3", *command)
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert f"--max-iter before '{command[0]}' are the training run's options" in stderr


def test_csv_string_labels_are_trimmed_as_integer_labels_are(tmp_path):
    from training.data.datasets import load_dataset

    path = tmp_path / "labels.csv"
    path.write_text("label,a\ncat,1\n cat ,2\ndog,3\ndog ,4\n")
    assert load_dataset(path).y.tolist() == ["cat", "cat", "dog", "dog"]


def test_a_checkpoint_dir_of_the_users_keeps_its_files_and_loses_ours(python_m_training, tmp_path):
    """--checkpoint-dir pointed at a directory of the user's: the job's own checkpoint file
    is removed once the artifact is written, the user's files and the directory stay."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    args = [*npy_pair(tmp_path, X_OK, Y_OK), "--checkpoint-dir", mine, "--quiet"]
    code, _, stderr = python_m_training(*args, "--max-iter", "3", "--out", tmp_path / "out")
    assert code == 0, stderr
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
