"""The ``.npy`` reader without ``ast`` (``service/core/npy.py``): every array numpy writes reads
back with numpy's own header and values, every malformed header is refused naming what was
wrong, and many threads parse at once without an error."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from service.core.artifact import ArtifactError
from service.core.artifact.read import _parse_npy
from service.core.npy import NpyFormatError, parse_header_text, read_array, read_header
from service.errors import InvalidInput
from service.wire.arrays import parse_npy

MAX_HEADER = 65536 + 16
NUMBERS = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "f16"]
OTHERS = ["b1", "c8", "c16", "M8[ns]", "m8[s]", "U3", "S4"]  # plain, not numbers
SHAPES = [(), (0,), (5,), (3, 4), (0, 4), (2, 3, 4), (2, 0, 3)]


def written(array: np.ndarray, version: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=version, allow_pickle=False)
    return buffer.getvalue()


def numpys_header(data: bytes) -> tuple:
    """(shape, fortran_order, dtype) as numpy's reader parses them (ast.literal_eval; one
    thread here). Version 3.0 differs from 2.0 only in allowing UTF-8, which none of these
    headers hold."""
    fp = io.BytesIO(data)
    major, _ = np.lib.format.read_magic(fp)
    reader = (
        np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    )
    return reader(fp)


def arrays(rng):
    """Every plain dtype in both byte orders, every rank from 0-d to 3-d (empty ones too), in
    C and Fortran order."""
    for code in NUMBERS + OTHERS:
        for order in "<>":
            dtype = np.dtype(order + code)
            for shape in SHAPES:
                raw = rng.integers(
                    0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8
                )
                if dtype.kind == "b":
                    raw = raw % 2
                if dtype.kind in "fc":  # no NaN payloads: equality below compares values
                    values = rng.normal(size=int(np.prod(shape)) * (2 if dtype.kind == "c" else 1))
                    if dtype.kind == "c":
                        values = values[0::2] + 1j * values[1::2]
                    array = values.astype(dtype).reshape(shape)
                elif dtype.kind in "US":
                    array = np.array(["ab"] * int(np.prod(shape)), dtype=dtype).reshape(shape)
                else:
                    array = np.frombuffer(raw.tobytes(), dtype=dtype).reshape(shape)
                yield array
                if array.ndim >= 2:
                    yield np.asfortranarray(array)


def test_every_array_numpy_writes_reads_back_as_numpy_reads_it(rng):
    checked = 0
    for array in arrays(rng):
        for version in ((1, 0), (2, 0), (3, 0)):
            data = written(array, version)
            header = read_header(data, MAX_HEADER)
            shape, fortran_order, dtype = numpys_header(data)
            case = f"{array.dtype.str} {array.shape} v{version[0]} fortran={fortran_order}"
            assert (header.shape, header.fortran_order, header.dtype) == (
                shape,
                fortran_order,
                dtype,
            ), case
            assert header.version == version[0], case
            ours = read_array(data, MAX_HEADER)
            theirs = np.load(io.BytesIO(data), allow_pickle=False)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, case
            assert ours.flags.f_contiguous == theirs.flags.f_contiguous, case
            assert ours.flags.c_contiguous == theirs.flags.c_contiguous, case
            assert ours.tobytes(order="A") == theirs.tobytes(order="A"), case
            np.testing.assert_array_equal(ours, theirs, err_msg=case)
            checked += 1
    print(f"{checked} arrays read as numpy reads them")
    assert checked == 3 * (len(NUMBERS) + len(OTHERS)) * 2 * (len(SHAPES) + 4)


# dictionary literals numpy does not write but Python (and numpy's reader) would read the same
ACCEPTED = [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}",
    '{"descr": "<f4", "fortran_order": False, "shape": (2, 3,), }',
    "{'shape': (2, 3), 'descr': '<f4', 'fortran_order': True}",
    "\n{\t'descr' : '<f4' ,\r\n'fortran_order':False,'shape':(2,3)}\n\n",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': ( 7 , ), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0,), }" + " " * 200 + "\n",
]


@pytest.mark.parametrize("text", ACCEPTED)
def test_other_spellings_read_as_python_reads_them(text):
    import ast

    expected = ast.literal_eval(text)
    descr, fortran_order, shape = parse_header_text(text.encode())
    assert {"descr": descr, "fortran_order": fortran_order, "shape": shape} == expected


def npy_with_header(text: str | bytes, data: bytes = b"", version: int = 1) -> bytes:
    raw = text.encode("latin1") if isinstance(text, str) else text
    width = 2 if version == 1 else 4
    return b"\x93NUMPY" + bytes([version, 0]) + len(raw).to_bytes(width, "little") + raw + data


def header(**fields: str) -> str:
    """A header with the given entries replacing the valid defaults (written verbatim)."""
    entries = {"descr": "'<f4'", "fortran_order": "False", "shape": "(1,)", **fields}
    return "{" + ", ".join(f"'{k}': {v}" for k, v in entries.items()) + ", }"


MALFORMED = {
    # the dictionary
    "a duplicate key": (
        "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}",
        "'descr' twice",
    ),
    "an extra key": (header(extra="1"), "the key 'extra'"),
    "a missing key": ("{'descr': '<f4', 'shape': (1,)}", "lacks fortran_order"),
    "an empty dictionary": ("{}", "lacks descr, fortran_order, shape"),
    "not a dictionary": ("[1, 2, 3]", "expected '{'"),
    "code": ("__import__('os').system('true')", "not a readable dictionary"),
    "a set": ("{'descr', 'shape'}", "':' after the key 'descr'"),
    "an unquoted key": ("{descr: '<f4'}", "a key as a quoted string"),
    "two commas": (
        "{'descr': '<f4',, 'fortran_order': False, 'shape': (1,)}",
        "a key as a quoted string",
    ),
    "no comma": ("{'descr': '<f4' 'fortran_order': False, 'shape': (1,)}", "',' or '}'"),
    "text after the dictionary": (header() + " x", "only whitespace after"),
    "a second dictionary": (header() + header(), "only whitespace after"),
    "no closing brace": ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)", "',' or '}'"),
    # strings
    "a quote ending a string early": (
        "{'descr': '<f4, 'fortran_order': False, 'shape': (1,)}",
        "',' or '}'",
    ),
    "a string cut by the end": ("{'descr': '<f4", "unterminated string"),
    "a string cut by a line end": (
        "{'descr': '<f\n4', 'fortran_order': False, 'shape': (1,)}",
        "unterminated string",
    ),
    "an escape": (header(descr=r"'<f\x34'"), "escape"),
    "an escaped quote": (header(descr=r"'<f4\''"), "escape"),
    "a bytes prefix": (header(descr="b'<f4'"), "the descr as a quoted string"),
    "mismatched quotes": ("{'descr': \"<f4'}", "unterminated string"),
    # descr
    "a structured descr": (header(descr="[('a', '<f4')]"), "structured dtype"),
    "an object descr": (header(descr="'|O'"), "object, structured or subarray"),
    "a comma descr": (header(descr="'<i4,<f4'"), "not a plain dtype string"),
    "a subarray descr": (header(descr="'(2,)<i4'"), "not a plain dtype string"),
    "a dtype name": (header(descr="'float32'"), "not a plain dtype string"),
    "an unknown descr": (header(descr="'<q9'"), "not a dtype numpy knows"),
    "a void of 0 bytes": (header(descr="'|V0'"), "0 bytes"),
    "an integer descr": (header(descr="4"), "the descr as a quoted string"),
    # fortran_order
    "fortran_order 0": (header(fortran_order="0"), "True or False"),
    "fortran_order a string": (header(fortran_order="'False'"), "True or False"),
    "fortran_order None": (header(fortran_order="None"), "True or False"),
    "fortran_order lowercase": (header(fortran_order="false"), "True or False"),
    "fortran_order a longer name": (header(fortran_order="Trueish"), "not a longer name"),
    # shape
    "a negative size": (header(shape="(-1, 64)"), "a negative size"),
    "a signed size": (header(shape="(+1,)"), "a signed size"),
    "a nested tuple": (header(shape="(2, (3,))"), "a nested tuple"),
    "a list": (header(shape="[2, 3]"), "expected a tuple"),
    "an integer": (header(shape="5"), "expected a tuple"),
    "one size without its comma": (header(shape="(5)"), "trailing comma"),
    "a float size": (header(shape="(2.0,)"), "not a plain decimal integer"),
    "an underscore size": (header(shape="(1_000,)"), "not a plain decimal integer"),
    "a hex size": (header(shape="(0x10,)"), "not a plain decimal integer"),
    "a Python 2 long": (header(shape="(3L,)"), "not a plain decimal integer"),
    "a leading zero": (header(shape="(05,)"), "leading zero"),
    "a huge size": (header(shape="(" + "9" * 19 + ",)"), "19 digits"),
    "sizes past any memory": (
        header(shape="(999999999999999999, 999999999999999999)"),
        "more than any file holds",
    ),
    "65 dimensions": (header(shape="(" + "1, " * 65 + ")"), "more than 64 dimensions"),
    "an empty size": (header(shape="(,)"), "expected a size"),
    "an unclosed tuple": (header(shape="(2, 3"), "expected a size"),
    # characters
    "a vertical tab": (header().replace(" ", "\x0b", 1), "byte 0x0b"),
    "a form feed": (header().replace(" ", "\x0c", 1), "byte 0x0c"),
    "a NUL": (header() + "\x00", "byte 0x00"),
    "a no-break space (latin-1)": (header().replace(" ", "\xa0", 1), "byte 0xa0"),
    "a latin-1 letter in a key": (header().replace("descr", "d\xe9scr"), "byte 0xe9"),
    "DEL": (header() + "\x7f", "byte 0x7f"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_header_is_refused_naming_what_was_wrong(case):
    text, named = MALFORMED[case]
    data = npy_with_header(text, b"\0" * 4)
    with pytest.raises(NpyFormatError) as refused:
        read_array(data, MAX_HEADER)
    assert named in str(refused.value), str(refused.value)
    # the same message reaches a client (422) and an operator (the file named)
    with pytest.raises(InvalidInput) as wire:
        parse_npy(data, n_features=1, max_rows=10)
    assert named in str(wire.value)
    with pytest.raises(ArtifactError) as artifact:
        _parse_npy(Path("/models/m/offset.npy"), data)
    assert "/models/m/offset.npy: cannot be read as .npy" in str(artifact.value)
    assert named in str(artifact.value)


PREAMBLES = {
    "no magic": (b"\x93NUMPZ\x01\x00", "magic"),
    "too short": (b"\x93NUM", "magic"),
    "version 4": (b"\x93NUMPY\x04\x00\x00\x00", "version 4.0 is not supported"),
    "version 1.1": (b"\x93NUMPY\x01\x01\x00\x00", "version 1.1 is not supported"),
    "the length cut off": (b"\x93NUMPY\x02\x00\x05\x00", "length is cut off"),
    "a header longer than the data": (b"\x93NUMPY\x01\x00\xff\xff{", "only 1 follow"),
    "a header over the limit": (b"\x93NUMPY\x02\x00\x00\x00\x10\x00", "more than the 65552"),
    "a non-ASCII UTF-8 header (3.0)": (
        npy_with_header(header().replace("descr", "d€scr").encode(), version=3),
        "byte 0xe2",
    ),
    "invalid UTF-8 (3.0)": (npy_with_header(header().encode() + b"\xff", version=3), "byte 0xff"),
    "truncated data": (npy_with_header(header(shape="(3,)"), b"\0" * 11), "(truncated)"),
    "extra data": (
        npy_with_header(header(shape="(3,)"), b"\0" * 13),
        "(extra bytes after the array)",
    ),
}


@pytest.mark.parametrize("case", sorted(PREAMBLES))
def test_a_malformed_preamble_or_size_is_refused(case):
    data, named = PREAMBLES[case]
    with pytest.raises(NpyFormatError) as refused:
        read_array(data, MAX_HEADER)
    assert named in str(refused.value), str(refused.value)


def test_an_unaligned_header_gives_an_aligned_array():
    """Another writer's header of any length: the data is copied to an aligned array."""
    text = header(descr="'<f8'", shape="(4,)")  # 10 + len(text) is not a multiple of 8
    data = npy_with_header(text, np.arange(4, dtype="<f8").tobytes())
    assert (10 + len(text)) % 8
    array = read_array(data, MAX_HEADER)
    assert array.flags.aligned
    np.testing.assert_array_equal(array, np.arange(4.0))


class _Cycle:
    """Garbage that the collector finds inside another thread's allocations and whose
    finalizer runs Python code: the moment the GIL can change hands inside a parse."""

    def __del__(self):
        sum(range(20))


def test_many_threads_parse_at_once_without_an_error():
    """16 threads x 1,500 parses of every version, under the conditions that make
    ast.literal_eval fail on Python 3.11 (cycles collected mid-parse, a 1 us switch
    interval): no error, every parse right."""
    bodies = [written(np.arange(128, dtype="<f4").reshape(2, 64), (v, 0)) for v in (1, 2, 3)]
    bodies.append(written(np.asfortranarray(np.ones((3, 5), ">i8")), (1, 0)))
    expected = [np.load(io.BytesIO(b)) for b in bodies]
    errors: list[str] = []
    done = [0]
    start = threading.Barrier(16)

    def work():
        start.wait()
        for i in range(1500):
            garbage = _Cycle()
            garbage.me = garbage
            j = i % len(bodies)
            try:
                array = read_array(bodies[j], MAX_HEADER)
                if not np.array_equal(array, expected[j]):
                    errors.append(f"body {j} read wrong")
            except Exception as exc:
                errors.append(repr(exc))
            done[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(interval)
    print(f"{done[0]} parses from 16 threads, {len(errors)} errors")
    assert errors == [] and done[0] == 16 * 1500
