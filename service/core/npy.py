"""The ``.npy`` format read without ``ast``: the preamble, the header's dictionary literal and
the data, each checked strictly, for request bodies and artifact files alike.

numpy's reader (``np.load``) and ``ast.literal_eval`` build the header through CPython's AST
constructor, whose recursion counter is shared by every thread on Python 3.11: two threads
parsing at once can fail with ``SystemError: AST constructor recursion depth mismatch``
(CPython gh-106905). The header is a fixed dictionary literal, so it is read here by a small
scanner that holds no state outside the call::

    {'descr': '<f4', 'fortran_order': False, 'shape': (2, 64), }   + spaces, then '\\n'

Accepted: the three keys once each, in any order, with single or double quotes; ``descr`` a
plain dtype string (byte order, kind, size, and a datetime unit: ``'<f4'``, ``'|b1'``,
``'<M8[ns]'``); ``fortran_order`` ``True`` or ``False``; ``shape`` a tuple of decimal sizes
(``()``, ``(5,)``, ``(2, 3)``, a trailing comma allowed); a trailing comma after the last
entry; spaces, tabs and line ends between tokens and after the closing brace. Refused, with
:class:`NpyFormatError` naming what was found, where, and what was expected: anything else,
among it structured, subarray and object dtypes, escapes in strings, non-ASCII characters,
other whitespace, negative or nested sizes, and sizes past what memory could address.
Format versions 1.0, 2.0 and 3.0 (3.0 differs only in allowing UTF-8, which no accepted
header needs). numpy and the standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

MAGIC = b"\x93NUMPY"
VERSIONS = {1: 2, 2: 4, 3: 4}  # major version -> bytes of the little-endian header length
MAX_DIMS = 64  # numpy's NPY_MAXDIMS
MAX_SIZE_DIGITS = 18  # a size below 10**18 (an int64); their product is checked too
MAX_DATA_BYTES = 2**63 - 1  # the most a file or a buffer can hold
KEYS = ("descr", "fortran_order", "shape")
# byte order (optional), one kind letter, a size, a datetime unit: no commas, no parentheses
PLAIN_DESCR = re.compile(r"[<>|=]?[A-Za-z][0-9]{0,4}(\[[0-9]{0,4}[A-Za-z]{1,3}\])?")
# the header's tokens (the scanner's only state is its position)
_NOT_HEADER_BYTE = re.compile(rb"[^\x20-\x7e\t\r\n]")  # only printable ASCII, tab, CR, LF
_SPACE = re.compile(r"[ \t\r\n]*")
_STRING = re.compile(r"'([^'\\\t\r\n]*)'|\"([^\"\\\t\r\n]*)\"")
_DIGITS = re.compile(r"[0-9]+")
_NAME_CHAR = re.compile(r"[A-Za-z0-9_.]")  # one of these right after a token: a longer token


class NpyFormatError(ValueError):
    """An ``.npy`` preamble, header or data that is not what the format allows; the message
    names what was found, where, and what was expected."""


@dataclass(frozen=True)
class NpyHeader:
    """A parsed ``.npy`` header: what the data that follows it must be."""

    version: int  # the format's major version: 1, 2 or 3
    dtype: np.dtype
    fortran_order: bool
    shape: tuple[int, ...]
    data_offset: int  # where the data starts in the file or body

    @property
    def count(self) -> int:
        """How many elements the shape holds (1 for a 0-d array)."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def data_bytes(self) -> int:
        """How many bytes of data the header declares."""
        return self.count * self.dtype.itemsize


def read_header(data: bytes | bytearray | memoryview, max_header_bytes: int) -> NpyHeader:
    """The header of the ``.npy`` bytes ``data``: magic, version, header length (at most
    ``max_header_bytes``) and the dictionary, without touching the data."""
    if len(data) < 8 or bytes(data[:6]) != MAGIC:
        raise NpyFormatError("not an .npy array (it does not start with the .npy magic)")
    major, minor = data[6], data[7]
    if major not in VERSIONS or minor != 0:
        raise NpyFormatError(
            f".npy format version {major}.{minor} is not supported (1.0, 2.0 or 3.0)"
        )
    width = VERSIONS[major]
    start = 8 + width
    if len(data) < start:
        raise NpyFormatError("the .npy header is truncated (its length is cut off)")
    header_len = int.from_bytes(data[8:start], "little")
    if header_len > max_header_bytes:
        raise NpyFormatError(
            f"the .npy header declares {header_len} bytes, more than the {max_header_bytes} "
            "a header may have"
        )
    if start + header_len > len(data):
        raise NpyFormatError(
            f"the .npy header declares {header_len} bytes, only {len(data) - start} follow "
            "(truncated)"
        )
    descr, fortran_order, shape = parse_header_text(bytes(data[start : start + header_len]))
    dtype = dtype_of(descr)
    header = NpyHeader(major, dtype, fortran_order, shape, start + header_len)
    if header.data_bytes > MAX_DATA_BYTES:
        raise NpyFormatError(
            f"the .npy shape {shape} of {descr} declares {header.data_bytes} bytes of data, "
            f"more than any file holds ({MAX_DATA_BYTES})"
        )
    return header


def read_array(data: bytes | bytearray | memoryview, max_header_bytes: int) -> np.ndarray:
    """The array in the ``.npy`` bytes ``data`` (a view of them, no copy when aligned):
    the header read by :func:`read_header`, then exactly the bytes it declares."""
    header = read_header(data, max_header_bytes)
    return array_of(data, header)


def array_of(data: bytes | bytearray | memoryview, header: NpyHeader) -> np.ndarray:
    """The data after ``header`` as an array of its dtype, shape and order; NpyFormatError
    unless exactly the declared number of bytes follow the header."""
    actual = len(data) - header.data_offset
    if actual != header.data_bytes:
        raise NpyFormatError(
            f"the .npy header declares {header.shape} {header.dtype} ({header.data_bytes} "
            f"bytes of data), {actual} bytes follow the header"
            + (" (truncated)" if actual < header.data_bytes else " (extra bytes after the array)")
        )
    flat = np.frombuffer(data, dtype=header.dtype, count=header.count, offset=header.data_offset)
    if not flat.flags.aligned:  # a header of another writer's length: the data copied aligned
        flat = flat.copy()
    if header.fortran_order:
        return flat.reshape(header.shape[::-1]).transpose()
    return flat.reshape(header.shape)


def dtype_of(descr: str) -> np.dtype:
    """The dtype a header's ``descr`` names: a plain one (no fields, no subarray, no
    objects, at least one byte)."""
    if PLAIN_DESCR.fullmatch(descr) is None:
        raise NpyFormatError(
            f"the .npy descr {descr!r} is not a plain dtype string such as '<f4' (byte "
            "order, kind, size)"
        )
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise NpyFormatError(f"the .npy descr {descr!r} is not a dtype numpy knows") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise NpyFormatError(
            f"the .npy dtype is {descr!r}, an object, structured or subarray dtype; "
            "expected a plain number, boolean, string or time dtype"
        )
    if dtype.itemsize == 0:
        raise NpyFormatError(f"the .npy descr {descr!r} has items of 0 bytes")
    return dtype


def parse_header_text(raw: bytes) -> tuple[str, bool, tuple[int, ...]]:
    """(descr, fortran_order, shape) from the header's bytes: one dictionary literal with
    exactly the keys descr, fortran_order and shape."""
    bad = _NOT_HEADER_BYTE.search(raw)
    if bad is not None:
        raise NpyFormatError(
            f"the .npy header holds the byte 0x{raw[bad.start()]:02x} at offset {bad.start()}; "
            "a header is printable ASCII, spaces, tabs and line ends"
        )
    return _Scanner(raw.decode("ascii")).header()


class _Scanner:
    """A cursor over one header's text; each method consumes one piece of the grammar (every
    token matched by a regular expression compiled once: no state outside the call)."""

    def __init__(self, text: str):
        self.text = text
        self.at = 0

    def fail(self, expected: str) -> NpyFormatError:
        found = repr(self.text[self.at : self.at + 12]) if self.at < len(self.text) else "its end"
        return NpyFormatError(
            f"the .npy header is not a readable dictionary of descr, fortran_order and shape: "
            f"expected {expected} at offset {self.at}, found {found}"
        )

    def take(self, token: str) -> bool:
        """Skip whitespace, then consume ``token`` if it comes next."""
        self.at = _SPACE.match(self.text, self.at).end()
        if self.text.startswith(token, self.at):
            self.at += len(token)
            return True
        return False

    def header(self) -> tuple[str, bool, tuple[int, ...]]:
        if not self.take("{"):
            raise self.fail("'{'")
        values: dict[str, object] = {}
        while not self.take("}"):
            key_at = self.at
            key = self.string()
            if key not in KEYS:
                raise NpyFormatError(
                    f"the .npy header has the key {key!r} at offset {key_at}; expected "
                    "exactly descr, fortran_order and shape"
                )
            if key in values:
                raise NpyFormatError(
                    f"the .npy header has the key {key!r} twice (again at offset {key_at})"
                )
            if not self.take(":"):
                raise self.fail(f"':' after the key {key!r}")
            values[key] = self.value(key)
            if not self.take(","):
                if not self.take("}"):
                    raise self.fail("',' or '}'")
                break
        self.at = _SPACE.match(self.text, self.at).end()
        if self.at != len(self.text):
            raise self.fail("only whitespace after the closing '}'")
        missing = [key for key in KEYS if key not in values]
        if missing:
            raise NpyFormatError(
                f"the .npy header lacks {', '.join(missing)}; expected exactly descr, "
                "fortran_order and shape"
            )
        return values["descr"], values["fortran_order"], values["shape"]  # type: ignore[return-value]

    def value(self, key: str) -> object:
        if key == "descr":
            return self.string(what="the descr")
        if key == "fortran_order":
            if self.take("True"):
                value = True
            elif self.take("False"):
                value = False
            else:
                raise self.fail("fortran_order True or False")
            if _NAME_CHAR.match(self.text, self.at):
                raise self.fail("fortran_order True or False, not a longer name")
            return value
        return self.shape()

    def string(self, what: str = "a key") -> str:
        """A quoted string: ' or ", no escapes, on one line."""
        self.at = start = _SPACE.match(self.text, self.at).end()
        found = _STRING.match(self.text, start)
        if found is not None:
            self.at = found.end()
            return found.group(1) if found.group(1) is not None else found.group(2)
        quote = self.text[start : start + 1]
        if quote in ("[", "(") and what == "the descr":
            raise NpyFormatError(
                f"the .npy descr at offset {start} is a list or tuple (a structured dtype); "
                "expected a string such as '<f4'"
            )
        if quote not in ("'", '"'):
            raise self.fail(f"{what} as a quoted string")
        end = start + 1
        while end < len(self.text) and self.text[end] not in (quote, "\\", "\t", "\r", "\n"):
            end += 1
        if self.text[end : end + 1] == "\\":
            raise NpyFormatError(
                f"the .npy header has an escape (backslash) at offset {end}; its strings are plain"
            )
        raise NpyFormatError(
            f"the .npy header has an unterminated string starting at offset {start}"
        )

    def shape(self) -> tuple[int, ...]:
        """A tuple of sizes: (), (n,), (n, m), (n, m,)."""
        if not self.take("("):
            raise self.shape_error("expected a tuple such as (2, 3) or (5,)")
        sizes: list[int] = []
        while not self.take(")"):
            sizes.append(self.size())
            if len(sizes) > MAX_DIMS:
                raise self.shape_error(f"more than {MAX_DIMS} dimensions")
            if not self.take(","):
                if not self.take(")"):
                    raise self.shape_error(f"expected ',' or ')' at offset {self.at}")
                if len(sizes) == 1:
                    raise self.shape_error(
                        "a shape of one dimension needs its trailing comma, as in (5,)"
                    )
                break
        return tuple(sizes)

    def size(self) -> int:
        self.at = start = _SPACE.match(self.text, self.at).end()
        found = _DIGITS.match(self.text, start)
        if found is None:
            char = self.text[start : start + 1]
            what = {"-": "a negative size", "(": "a nested tuple", "+": "a signed size"}.get(
                char, repr(char) if char else "its end"
            )
            raise self.shape_error(f"expected a size (digits) at offset {start}, found {what}")
        digits = found.group()
        self.at = found.end()
        if _NAME_CHAR.match(self.text, self.at):
            raise self.shape_error(
                f"the size at offset {start} is not a plain decimal integer "
                f"({self.text[start : self.at + 1]!r}...)"
            )
        if len(digits) > 1 and digits[0] == "0":
            raise self.shape_error(f"the size {digits!r} at offset {start} has a leading zero")
        if len(digits) > MAX_SIZE_DIGITS:
            raise self.shape_error(
                f"the size at offset {start} has {len(digits)} digits, more than any array "
                f"holds (at most {MAX_SIZE_DIGITS})"
            )
        return int(digits)

    def shape_error(self, what: str) -> NpyFormatError:
        return NpyFormatError(f"the .npy shape is not a tuple of sizes: {what}")
