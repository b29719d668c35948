"""benchmarks/harness/rdata.py, the reader of R data files: a data frame written here in R's
XDR serialisation (by the small writer below, from R's serialize.c layout) reads back exactly,
compressed three ways; a file of another format or with a type the reader lacks is refused;
and the letters file, when prepared, matches UCI's description."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.data import (  # noqa: E402
    LETTERS_PATH,
    SATELLITE_PATH,
    SHUTTLE_PATH,
    letters,
    satellite,
    shuttle,
)
from harness.rdata import data_frame, read_rdata  # noqa: E402

HAS_ATTRIBUTES, HAS_TAG, IS_OBJECT = 1 << 9, 1 << 10, 1 << 8


def _int(value: int) -> bytes:
    return struct.pack(">i", value)


def _chars(text: str | None) -> bytes:
    if text is None:
        return _int(9) + _int(-1)
    raw = text.encode()
    return _int(9 | (1 << 12)) + _int(len(raw)) + raw


class _Writer:
    """R's XDR serialisation of symbols (with back references), pairlists and vectors."""

    def __init__(self):
        self.symbols: list[str] = []

    def symbol(self, name: str) -> bytes:
        if name in self.symbols:
            return _int(255 | ((self.symbols.index(name) + 1) << 8))
        self.symbols.append(name)
        return _int(1) + _chars(name)

    def pairlist(self, items: dict) -> bytes:
        """``items``: name -> a function writing the value, called after the name is written,
        so that symbols are numbered in the order they appear in the stream, as R numbers them."""
        out = b""
        for name, value in items.items():
            out += _int(2 | HAS_TAG) + self.symbol(name)
            out += value()
        return out + _int(254)

    def vector(self, kind: int, body: bytes, attributes: dict | None = None) -> bytes:
        flags = kind | ((HAS_ATTRIBUTES | IS_OBJECT) if attributes else 0)
        return _int(flags) + body + (self.pairlist(attributes) if attributes else b"")

    def strings(self, texts) -> bytes:
        return self.vector(16, _int(len(texts)) + b"".join(_chars(t) for t in texts))

    def integers(self, values, attributes=None) -> bytes:
        return self.vector(13, _int(len(values)) + b"".join(_int(v) for v in values), attributes)

    def doubles(self, values) -> bytes:
        return self.vector(14, _int(len(values)) + struct.pack(f">{len(values)}d", *values))


def _frame_file(writer: _Writer, version: int = 2) -> bytes:
    def letter():
        return writer.integers(
            [2, 1, -(2**31), 2],
            {
                "levels": lambda: writer.strings(["A", "B"]),
                "class": lambda: writer.strings(["factor"]),
            },
        )

    def frame():
        return writer.vector(
            19,
            _int(2) + letter() + writer.doubles([1.5, -2.0, 0.0, 1e300]),
            {
                "names": lambda: writer.strings(["lettr", "x.box"]),
                "class": lambda: writer.strings(["data.frame"]),
                "row.names": lambda: writer.integers([-(2**31), -4]),
            },
        )

    header = b"RDX%d\nX\n" % version + _int(version) + _int(0x040200) + _int(0x020300)
    if version == 3:
        header += _int(5) + b"UTF-8"
    return header + writer.pairlist({"frame": frame})


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
@pytest.mark.parametrize("version", [2, 3])
def test_a_data_frame_reads_back_exactly(tmp_path, compress, version):
    path = tmp_path / "frame.rda"
    path.write_bytes(compress(_frame_file(_Writer(), version)))
    objects = read_rdata(path)
    assert list(objects) == ["frame"]
    assert objects["frame"].attribute("class") == ["data.frame"]
    columns = data_frame(objects["frame"])
    assert columns["lettr"] == ["B", "A", None, "B"]
    np.testing.assert_array_equal(columns["x.box"], [1.5, -2.0, 0.0, 1e300])


def test_a_file_of_another_format_is_refused(tmp_path):
    path = tmp_path / "ascii.rda"
    path.write_bytes(gzip.compress(b"RDA2\nA\n2\n"))
    with pytest.raises(ValueError, match="not an XDR R data file"):
        read_rdata(path)


def test_a_type_the_reader_lacks_is_named(tmp_path):
    closure = _int(3) + _int(254)  # CLOSXP: R code, not data
    path = tmp_path / "closure.rda"
    path.write_bytes(
        b"RDX2\nX\n" + _int(2) + _int(0) + _int(0) + _Writer().pairlist({"f": lambda: closure})
    )
    with pytest.raises(ValueError, match="R type 3"):
        read_rdata(path)


@pytest.mark.skipif(not LETTERS_PATH.exists(), reason="benchmarks/prepare_uci.py not run")
def test_the_prepared_letters_match_uci():
    X, y, X_val, y_val, X_test, y_test = letters()
    assert X.shape == (14400, 16) and X_val.shape == (1600, 16) and X_test.shape == (4000, 16)
    assert np.bincount(np.concatenate([y, y_val, y_test]), minlength=26)[0] == 789
    # UCI's first row: T,2,8,3,5,1,8,13,0,6,6,10,8,0,8,0,8
    first = np.load(LETTERS_PATH)
    np.testing.assert_array_equal(first["X"][0], [2, 8, 3, 5, 1, 8, 13, 0, 6, 6, 10, 8, 0, 8, 0, 8])
    assert first["y"][0] == ord("T") - ord("A")


@pytest.mark.skipif(not SHUTTLE_PATH.exists(), reason="benchmarks/prepare_uci.py not run")
def test_the_prepared_shuttle_matches_uci():
    X, y, X_test, y_test = shuttle()
    assert X.shape == (43500, 9) and X_test.shape == (14500, 9)
    assert np.bincount(y, minlength=7).tolist() == [34108, 37, 132, 6748, 2458, 6, 11]
    assert np.bincount(y_test, minlength=7).tolist() == [11478, 13, 39, 2155, 809, 4, 2]
    # UCI's first training row: 50 21 77 0 28 0 27 48 22, class 2 (Fpv Close)
    np.testing.assert_array_equal(X[0], [50, 21, 77, 0, 28, 0, 27, 48, 22])
    assert y[0] == 1


@pytest.mark.skipif(not SATELLITE_PATH.exists(), reason="benchmarks/prepare_uci.py not run")
def test_the_prepared_satellite_matches_uci():
    X, y, X_test, y_test = satellite()
    assert X.shape == (4435, 36) and X_test.shape == (2000, 36)
    assert np.bincount(y_test, minlength=6).tolist() == [461, 224, 397, 211, 237, 470]
    # UCI's first training row begins 92 115 120 94, class 3 (grey soil)
    np.testing.assert_array_equal(X[0, :4], [92, 115, 120, 94])
    assert y[0] == 2
