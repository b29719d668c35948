"""Reading an artifact: one descriptor of its directory pinned, every file read once into
memory, its sha256 checked on those bytes and the same bytes parsed, so what was verified
is what is served even if the path is repointed while it is read."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from service import __version__
from service.core.artifact.format import (
    ARRAY_SPECS,
    FORMAT_NAME,
    MANIFEST_FILE,
    OPTIONAL_ARRAYS,
    REQUIRED_MANIFEST_KEYS,
    SCHEMA_VERSION,
    Artifact,
    ArtifactError,
    legacy_model_version_of,
    model_version_of,
)
from service.core.artifact.invariants import check_arrays, check_manifest
from service.core.npy import NpyFormatError, read_array


class _PinnedDirectory:
    """An artifact directory held open by one file descriptor; files are opened relative to
    it, so repointing a symlink or exchanging the directory cannot mix two artifacts. It
    remembers the manifest's bytes and the (size, mtime, inode) of every file it read, so
    that :meth:`fingerprint` describes exactly what was read."""

    def __init__(self, root: Path):
        self.root = root
        self.manifest_bytes: bytes | None = None
        self.opened: dict[str, tuple[int, int, int]] = {}  # file name -> its stats when read
        try:
            self.fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except (FileNotFoundError, NotADirectoryError):
            raise ArtifactError(f"{root}: no artifact directory there") from None
        except OSError as exc:
            raise ArtifactError(f"{root}: cannot be opened ({exc.strerror})") from None
        self.resolved = _name_of(self.fd, root)  # where the path led when it was opened

    def __enter__(self) -> _PinnedDirectory:
        return self

    def __exit__(self, *exc_info) -> None:
        os.close(self.fd)

    def manifest(self) -> bytes:
        """The bytes of manifest.json, read once (and remembered for the fingerprint)."""
        self.manifest_bytes = self.read(MANIFEST_FILE, "the manifest", MAX_MANIFEST_BYTES)
        return self.manifest_bytes

    def fingerprint(self) -> tuple | None:
        """The identity of what this directory's reads saw, or None before the manifest was
        read: the directory's (device, inode) from its descriptor, the sha256 of the manifest
        bytes read, and (name, size, mtime, inode) of every file the manifest lists, as it
        was when read (the others as they are now, looked up through the descriptor)."""
        if self.manifest_bytes is None:
            return None
        identity = os.fstat(self.fd)
        stats = []
        files = _listed_files(self.manifest_bytes)
        for name in sorted(files):
            entry = files[name]
            file_name = entry.get("path") if isinstance(entry, dict) else None
            seen = self.opened.get(file_name) if isinstance(file_name, str) else None
            if seen is None:
                try:
                    st = os.stat(str(file_name), dir_fd=self.fd)
                    seen = (st.st_size, st.st_mtime_ns, st.st_ino)
                except (OSError, TypeError, ValueError):
                    seen = (None, None, None)
            stats.append((name, *seen))
        return (
            identity.st_dev,
            identity.st_ino,
            hashlib.sha256(self.manifest_bytes).hexdigest(),
            tuple(stats),
        )

    def read(self, name: str, what: str, max_bytes: int | None = None) -> bytes:
        """The whole file ``name`` inside the directory, read once; ArtifactError before
        anything is read when it is larger than ``max_bytes`` (what the manifest says it
        holds: a huge or sparse file is not read to find out that its checksum is wrong)."""
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ArtifactError(
                f"{self.root / MANIFEST_FILE}: {what} path {name!r} is not a plain file name"
            )
        try:
            # O_NONBLOCK: opening a FIFO for reading must not wait for a writer
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=self.fd)
        except FileNotFoundError:
            raise ArtifactError(f"{self.root / name}: missing ({what})") from None
        except OSError as exc:
            raise ArtifactError(f"{self.root / name}: cannot be opened ({exc.strerror})") from None
        info = os.fstat(fd)
        self.opened[name] = (info.st_size, info.st_mtime_ns, info.st_ino)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ArtifactError(
                f"{self.root / name}: expected a regular file ({what}), got a "
                f"{_file_kind(info.st_mode)}"
            )
        if max_bytes is not None and info.st_size > max_bytes:
            os.close(fd)
            raise ArtifactError(
                f"{self.root / name}: {info.st_size} bytes, more than the {max_bytes} its "
                f"manifest entry allows ({what})"
            )
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as fh:
            return fh.read()


MAX_MANIFEST_BYTES = 16 * 2**20  # a manifest is metadata: a larger one is refused unread
NPY_HEADER_MAX_BYTES = 65536 + 16  # the .npy header before an array's data, at most


def _listed_files(manifest_bytes: bytes) -> dict:
    """The manifest's ``files`` object, or {} when the bytes are not such a manifest."""
    try:
        files = json.loads(manifest_bytes.decode("utf-8")).get("files", {})
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, RecursionError):
        return {}
    return files if isinstance(files, dict) else {}


def _name_of(fd: int, root: Path) -> str:
    """The path the kernel gives the directory open as ``fd`` (where ``root``'s symlinks
    led); without /proc, ``root`` resolved."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return str(root.resolve())


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")


def _parse_manifest(root: Path, data: bytes) -> dict[str, Any]:
    manifest_path = root / MANIFEST_FILE
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{manifest_path}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise ArtifactError(f"{manifest_path}: not valid JSON (nested too deeply)") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(
            f"{manifest_path}: expected a JSON object, got {type(manifest).__name__}"
        )
    missing = [key for key in REQUIRED_MANIFEST_KEYS if key not in manifest]
    if missing:
        raise ArtifactError(f"{manifest_path}: missing keys {missing}")
    if manifest["format"] != FORMAT_NAME:
        raise ArtifactError(
            f"{manifest_path}: format is {manifest['format']!r}, expected {FORMAT_NAME!r}"
        )
    if manifest["schema_version"] != SCHEMA_VERSION:
        raise ArtifactError(
            f"{manifest_path}: schema_version is {manifest['schema_version']!r}, this nca-knn "
            f"{__version__} reads schema_version {SCHEMA_VERSION}"
        )
    if not isinstance(manifest["files"], dict) or not all(
        isinstance(entry, dict) for entry in manifest["files"].values()
    ):
        raise ArtifactError(f"{manifest_path}: 'files' must be an object of objects")
    try:
        check_manifest(manifest)
    except ArtifactError as exc:
        raise ArtifactError(f"{manifest_path}: {exc}") from None
    return manifest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check manifest.json of the artifact at ``path`` (no array is opened)."""
    root = Path(path)
    with _PinnedDirectory(root) as directory:
        return _parse_manifest(root, directory.manifest())


def _parse_npy(file_path: Path, data: bytes) -> np.ndarray:
    """The array in ``data`` (``service.core.npy``: no ``ast``, safe from any thread), as a
    fresh writable array, as ``np.load`` gives."""
    try:
        return read_array(data, NPY_HEADER_MAX_BYTES).copy()
    except NpyFormatError as exc:
        raise ArtifactError(f"{file_path}: cannot be read as .npy ({exc})") from None


def read_artifact(path: str | os.PathLike) -> Artifact:
    """Load the artifact at ``path``, verifying checksums, dtypes, shapes and consistency.

    Each file is read once, through a descriptor of the directory opened first; the bytes
    whose sha256 is checked are the bytes that are parsed. The artifact's ``fingerprint``
    describes those bytes (``_PinnedDirectory.fingerprint``), and so does the
    ``fingerprint`` of an ArtifactError raised once the manifest was read: a poller that
    compares it with :func:`artifact_fingerprint` sees any change made after the read.
    """
    root = Path(path)
    with _PinnedDirectory(root) as directory:
        try:
            artifact = _read_pinned(root, directory)
        except ArtifactError as exc:
            exc.fingerprint = directory.fingerprint()
            raise
        return dataclasses.replace(
            artifact, fingerprint=directory.fingerprint(), directory=directory.resolved
        )


def _read_pinned(root: Path, directory: _PinnedDirectory) -> Artifact:
    """The artifact in the pinned ``directory``, every file read and checked."""
    manifest = _parse_manifest(root, directory.manifest())
    files = manifest["files"]
    dims = check_manifest(manifest)
    arrays: dict[str, np.ndarray] = {}
    for name in ARRAY_SPECS:
        array = _read_array(root, directory, files, name, dims)
        if array is not None:
            arrays[name] = array
    index_bytes = None
    if "index" in files:
        entry = files["index"]
        size = entry.get("bytes")
        index_bytes = directory.read(
            entry.get("path"),
            "listed in the manifest as index",
            size if isinstance(size, int) and not isinstance(size, bool) else 0,
        )
        _check_sha256(root / entry["path"], index_bytes, entry.get("sha256"))
    expected_version = model_version_of(manifest)
    stored = manifest.get("model_version", expected_version)
    if stored not in (expected_version, legacy_model_version_of(files)):
        raise ArtifactError(
            f"{root / MANIFEST_FILE}: model_version is {stored!r} but the files and fields it "
            f"lists hash to {expected_version!r} (a manifest from another artifact, or edited)"
        )
    manifest = {**manifest, "model_version": expected_version}
    try:
        check_arrays(arrays, len(manifest["classes"]))
    except ArtifactError as exc:
        raise ArtifactError(f"{root}/{exc}") from None
    if "ids" not in arrays:
        arrays["ids"] = np.arange(dims["N"], dtype=np.int64)
    return Artifact(path=root, manifest=manifest, index_bytes=index_bytes, **arrays)


def _read_array(root: Path, directory, files: dict, name: str, dims: dict) -> np.ndarray | None:
    """The array ``name`` read once through the pinned directory, its sha256, dtype and shape
    (symbols resolved with ``dims``) checked; None for an optional array that is absent."""
    file_name, dtype, symbols = ARRAY_SPECS[name]
    entry = files.get(name)
    if entry is None:
        if name in OPTIONAL_ARRAYS:
            return None
        raise ArtifactError(f"{root / MANIFEST_FILE}: no entry for required file {file_name}")
    expected = tuple(dims[s] for s in symbols)
    largest = NPY_HEADER_MAX_BYTES + int(np.prod(expected, dtype=np.int64)) * dtype.itemsize
    data = directory.read(entry.get("path"), f"listed in the manifest as {name}", largest)
    file_path = root / entry["path"]
    _check_sha256(file_path, data, entry.get("sha256"))
    array = _parse_npy(file_path, data)
    if array.dtype != dtype:
        raise ArtifactError(f"{file_path}: expected dtype {dtype}, got {array.dtype}")
    if array.shape != expected or list(array.shape) != list(entry.get("shape", [])):
        raise ArtifactError(
            f"{file_path}: expected shape {expected}, got {array.shape} "
            f"(manifest says {tuple(entry.get('shape', ()))})"
        )
    return array


def _check_sha256(file_path: Path, data: bytes, expected: Any) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ArtifactError(
            f"{file_path}: checksum mismatch, expected sha256 {expected}, got {actual} "
            "(the file is corrupted or was changed after writing)"
        )


def artifact_fingerprint(path: str | os.PathLike) -> tuple | None:
    """What identifies the bytes at ``path`` without reading the arrays, or None if there is
    no readable manifest: the directory's identity, the manifest's sha256 and (size,
    mtime, inode) of every file it lists (``_PinnedDirectory.fingerprint``; equal to the
    ``fingerprint`` of :func:`read_artifact` while nothing changes). It changes when the
    artifact is replaced, repointed, rewritten or healed, so a poller can tell whether the
    path still names what it loaded, and retry a failed version once it changes."""
    try:
        with _PinnedDirectory(Path(path)) as directory:
            directory.manifest()
            return directory.fingerprint()
    except ArtifactError:
        return None


def read_extras(artifact: Artifact) -> dict[str, bytes]:
    """The extra files (report, plots) an artifact lists, each verified against its sha256."""
    out: dict[str, bytes] = {}
    with _PinnedDirectory(artifact.path) as directory:
        for name, entry in artifact.manifest.get("extras", {}).items():
            size = entry.get("bytes")
            data = directory.read(
                name,
                "listed in the manifest as an extra file",
                size if isinstance(size, int) and not isinstance(size, bool) else 0,
            )
            _check_sha256(artifact.path / name, data, entry.get("sha256"))
            out[name] = data
    return out
