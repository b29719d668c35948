"""Saved state that a killed command reads back: written atomically, keyed by a digest.

The fit's checkpoint (``training.model.checkpoint``) and the prototype learning's
(``training.references.checkpoint``) are both an ``.npz`` of arrays written here: to a
temporary file in the same directory, fsynced, then renamed over the last one, so a reader
sees the old file or the new one, never half of one. Each is keyed by a SHA-256 of what
decides the work (the rows, the labels, the settings, this package's version), so that the
state of other work is refused rather than used. Both are read back by :func:`read_state`,
which refuses a damaged file in one ValueError that names it and the remedy.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from training.errors import describe_os_error


def package_version() -> str:
    """This installation's version of the package (a checkpoint of another is refused)."""
    try:
        return importlib.metadata.version("nca-knn")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def digest_array(digest: hashlib._Hash, array: np.ndarray | None) -> None:
    """Feed a dense array's dtype, shape and bytes to ``digest`` (None: a marker)."""
    if array is None:
        digest.update(b"none")
        return
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(memoryview(array).cast("B"))


def is_npz_archive(path: Path) -> bool:
    """Whether ``path`` is an .npz (zip) archive, as every saved state is (numpy would call
    any other file pickled data). OSError when it cannot be read: the caller says so and
    keeps the file, which may be a resumable state this user cannot read."""
    with open(path, "rb") as fh:
        return zipfile.is_zipfile(fh)


def read_state(
    path: Path, kind: str, format_name: str, remedy: str, required: tuple = ()
) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of the saved state ``path``: its JSON member ``meta`` (a dict whose
    "format" is ``format_name``) and its other members by name, ``required`` among them.
    ValueError naming the file, what is wrong with it and ``remedy`` (what to remove to
    start over) when it cannot be read, is not an .npz archive, does not read back or is
    of another format; ``kind`` names the state ("fit checkpoint"). The caller checks the
    key, whose field and meaning are its own."""
    try:
        archive = is_npz_archive(path)
    except OSError as exc:  # kept: a state the user cannot read may be resumable
        raise ValueError(
            f"checkpoint {path} cannot be read ({describe_os_error(exc)}): make it readable "
            f"to resume from it, or {remedy}"
        ) from None
    if not archive:
        raise ValueError(f"checkpoint {path}: not a {kind} (not an .npz archive); {remedy}")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [name for name in ("meta", *required) if name not in data.files]
            if missing:
                raise KeyError(f"no member {', '.join(missing)}")
            arrays = {name: np.asarray(data[name]) for name in data.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (
        OSError,
        ValueError,
        KeyError,
        EOFError,
        zipfile.BadZipFile,
        NotImplementedError,  # a member compressed by a method zipfile does not read
        RecursionError,  # JSON nested beyond the parser's depth
        MemoryError,
    ) as exc:
        raise ValueError(f"checkpoint {path}: not a readable {kind} ({exc}); {remedy}") from None
    if not isinstance(meta, dict) or meta.get("format") != format_name:
        raise ValueError(f"checkpoint {path}: not a {kind} of this format; {remedy}")
    return meta, arrays


def wrong_arrays(arrays: dict[str, np.ndarray], vectors: tuple, pairs: tuple = ()) -> str | None:
    """What is wrong with the arrays of a saved iterate (None: nothing), whose key matched
    (so the file was changed after its save): every array finite floats, the ``vectors``
    (P,) of one length, the ``pairs`` (L-BFGS's curvature pairs) (m, P), or (0, *) when
    there are none, of one shape."""
    for name, array in arrays.items():
        if array.dtype.kind != "f" or not np.all(np.isfinite(array)):
            return f"its {name} is not all finite numbers"
    shapes = {arrays[name].shape for name in vectors}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        return f"its {', '.join(vectors)} are not vectors of one length"
    (p,) = shapes.pop()
    for name in pairs:
        shape = arrays[name].shape
        if len(shape) != 2 or (shape[0] and shape[1] != p):
            return f"its {name} has shape {shape}, expected (pairs, {p})"
    if len({arrays[name].shape for name in pairs}) > 1:
        return f"its {', '.join(pairs)} differ in shape"
    return None


def checkpoint_beside(out: str | Path) -> Path:
    """The checkpoint directory of a command writing ``out``: ``.NAME.checkpoint`` beside it
    (on the same volume, so that a restarted job finds it)."""
    absolute = Path(out).absolute()
    return absolute.with_name(f".{absolute.name}.checkpoint")


def write_npz_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as the .npz ``path``, creating its directory: a temporary file beside
    it, fsynced, renamed over ``path``. OSError when the disk refuses; no partial file
    stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
