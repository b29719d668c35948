"""A reader for the R data files (``.rda``) a Debian R package ships data sets in.

Only what a data frame of numbers and factors needs: R's XDR serialisation, format 2 or 3
(big-endian int32 and float64), of pairlists, symbols, strings, logical, integer and double
vectors, lists and attributes. Anything else (closures, environments, bytecode) raises
``ValueError`` naming the type, so a file this reader does not understand is never read
wrongly.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
from pathlib import Path

import numpy as np

# R's SEXPTYPE codes (src/include/Rinternals.h)
SYMBOL = 1
PAIRLIST = 2
CHARS = 9  # one string (CHARSXP)
LOGICAL = 10
INTEGER = 13
DOUBLE = 14
STRINGS = 16  # a character vector (STRSXP)
LIST = 19  # a generic vector (VECSXP): data frames are these
# the serialisation's special codes (src/main/serialize.c)
REFERENCE = 255  # an earlier symbol again, by its number
NIL_VALUE = 254
GLOBAL_ENV = 253
EMPTY_ENV = 242
BASE_ENV = 241
NA_INTEGER = -(2**31)


class RObject:
    """An R value with its attributes: ``value`` (a numpy array, list of strings or of
    RObjects) and ``attributes`` (name -> RObject)."""

    def __init__(self, value, attributes: dict | None = None):
        self.value = value
        self.attributes = attributes or {}

    def attribute(self, name: str):
        found = self.attributes.get(name)
        return None if found is None else found.value


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.at = 0
        self.references: list = []

    def ints(self, count: int) -> np.ndarray:
        out = np.frombuffer(self.data, dtype=">i4", count=count, offset=self.at)
        self.at += 4 * count
        return out.astype(np.int64)

    def int(self) -> int:
        return int(self.ints(1)[0])

    def length(self) -> int:
        n = self.int()
        if n == -1:  # a long vector: the length as two ints
            high, low = self.int(), self.int()
            n = (high << 32) + low
        return n

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        has_attributes, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (NIL_VALUE, GLOBAL_ENV, EMPTY_ENV, BASE_ENV):
            return None
        if kind == REFERENCE:
            index = flags >> 8 or self.int()
            return self.references[index - 1]
        if kind == SYMBOL:
            name = self.item()
            self.references.append(name)
            return name
        if kind == PAIRLIST:
            return self.pairlist(has_attributes, has_tag)
        if kind == CHARS:
            n = self.int()
            if n == -1:
                return None
            text = self.data[self.at : self.at + n].decode("utf-8", errors="replace")
            self.at += n
            return text
        if kind in (LOGICAL, INTEGER):
            value = self.ints(self.length())
        elif kind == DOUBLE:
            n = self.length()
            value = np.frombuffer(self.data, dtype=">f8", count=n, offset=self.at).astype(float)
            self.at += 8 * n
        elif kind in (STRINGS, LIST):
            value = [self.item() for _ in range(self.length())]
        else:
            raise ValueError(f"R type {kind} at byte {self.at} is not one this reader handles")
        attributes = self.item() if has_attributes else None
        return RObject(value, attributes)

    def pairlist(self, has_attributes: bool, has_tag: bool) -> dict:
        """A pairlist as name -> value (attributes, and the objects a .rda file holds)."""
        out: dict = {}
        while True:
            if has_attributes:
                self.item()
            tag = self.item() if has_tag else str(len(out))
            out[tag] = self.item()
            flags = self.int()
            kind = flags & 0xFF
            if kind == NIL_VALUE:
                return out
            if kind != PAIRLIST:
                raise ValueError(f"a pairlist ends in R type {kind}, not NULL")
            has_attributes, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))


def read_rdata(path: Path) -> dict:
    """The objects of an R ``save()`` file, name -> RObject. gzip, bzip2 and xz files are
    read; the format must be XDR ("RDX2"/"RDX3" then "X")."""
    raw = Path(path).read_bytes()
    for opener in (gzip.decompress, bz2.decompress, lzma.decompress):
        try:
            raw = opener(raw)
            break
        except (OSError, ValueError, lzma.LZMAError):
            continue
    if raw[:5] not in (b"RDX2\n", b"RDX3\n") or raw[5:7] != b"X\n":
        raise ValueError(f"{path}: not an XDR R data file (starts {raw[:7]!r})")
    reader = _Reader(raw)
    reader.at = 7
    version = reader.int()
    reader.ints(2)  # the writer's and the oldest reader's R versions
    if version == 3:
        reader.at += 4 + reader.int()  # the native encoding's name
    return reader.item()


def data_frame(frame: RObject) -> dict[str, np.ndarray | list[str]]:
    """A data frame's columns by name: numbers as arrays, factors as lists of their levels."""
    names = frame.attribute("names")
    columns = {}
    for name, column in zip(names, frame.value, strict=True):
        levels = column.attribute("levels")
        if levels is not None:
            columns[name] = [
                None if code == NA_INTEGER else levels[code - 1] for code in column.value
            ]
        else:
            columns[name] = column.value
    return columns
