"""Writing an artifact atomically: validate the pieces (``invariants``, the checks the
reader makes again), write every file into a staging
sibling directory, fsync each file and the directory, then rename it into place (exchanged
with an existing artifact in one step where the OS allows it). A writer killed half-way
leaves a ``.NAME.tmp-HOST-PID-*`` sibling; the next write into the same directory, to any
name, removes it once that process is gone (``remove_stale_staging``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime as _dt
import errno
import hashlib
import io
import json
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from service import __version__
from service.core.artifact.format import (
    ARRAY_SPECS,
    FORMAT_NAME,
    INDEX_FILE,
    MANIFEST_FILE,
    OWNED_MANIFEST_KEYS,
    SCHEMA_VERSION,
    STANDARDIZATION_RECORD,
    Artifact,
    ArtifactError,
    model_version_of,
)
from service.core.artifact.invariants import (
    check_arrays,
    check_classes,
    check_decision_rule,
    check_default_k,
    check_records,
)
from service.core.artifact.ownership import check_replaceable
from service.core.artifact.read import read_extras
from service.core.processes import process_alive


def _write_bytes_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _to_json_label(label: Any) -> Any:
    """A numpy scalar as its Python value (``check_classes`` says what is allowed)."""
    return label.item() if isinstance(label, np.generic) else label


def _coerce(name: str, array: Any) -> np.ndarray:
    """``array`` in its file's dtype (the invariants, finiteness included, are checked after
    the conversion: a float64 beyond float32 becomes inf)."""
    file_name, dtype, _ = ARRAY_SPECS[name]
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
        raise ArtifactError(f"{file_name}: expected a numeric array, got dtype {array.dtype}")
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise ArtifactError(f"{file_name}: contains NaN or Inf")
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(array, dtype=dtype)


_RENAME_EXCHANGE = 2


_AT_FDCWD = -100


def _exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE). False if unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename the staged directory to ``final``; replace an existing one without a gap."""
    if not final.exists() and not final.is_symlink():
        os.rename(staging, final)
        return
    if final.is_symlink() or not final.is_dir():
        raise ArtifactError(
            f"{final}: exists and is not an artifact directory; refusing to replace"
        )
    if _exchange_paths(staging, final):
        _remove_replaced(staging)  # staging now holds the old artifact
        return
    # Portable fallback: move the old one aside, move the new one in, restore on failure.
    backup = final.with_name(f".{final.name}.old-{_writer_tag()}-{uuid.uuid4().hex[:8]}")
    os.rename(final, backup)
    try:
        os.rename(staging, final)
    except BaseException:
        os.rename(backup, final)
        raise
    _remove_replaced(backup)


def _remove_replaced(old: Path) -> None:
    """Remove the replaced artifact ``old`` (a directory of plain files). One this user made
    read-only (mode 555: its files cannot be unlinked) is made writable first; what still
    cannot be removed is left, for the next write's :func:`remove_stale_staging` (a directory
    of another user's is refused before the write, by ``ownership.check_writable``)."""
    try:
        entry = os.lstat(old)
        if entry.st_uid == os.geteuid() and not entry.st_mode & stat.S_IWUSR:
            os.chmod(old, stat.S_IMODE(entry.st_mode) | stat.S_IRWXU)
    except OSError:
        pass
    shutil.rmtree(old, ignore_errors=True)


STALE_STAGING_SECONDS = 24 * 3600  # a staging entry this old is abandoned on any host

# .NAME.tmp-HOST-PID-HEX (a staging directory, or a link being made) and .NAME.old-HOST-PID-HEX
# (the previous artifact, moved aside by the portable replacement); HOST has no "-"
# the hex is uuid4's first 12 (tmp) or 8 (old) digits: a user's ".m.old-2023-11-05" is no match
_STAGING = re.compile(
    r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<tag>[A-Za-z0-9_]+-[0-9]+)-(?:[0-9a-f]{12}|[0-9a-f]{8})"
)


def _writer_tag() -> str:
    """HOST-PID of this writer, so that a later writer can tell whether it is still alive.
    HOST is the host name and, where ``/proc`` names it, the writer's PID namespace
    (``node_p4026531836``): writers in two containers that share a host name (host
    networking) and a volume number their processes apart and cannot ask about each
    other's, so each takes the other's entries for another host's, never for a dead
    writer's."""
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"
    try:
        host += f"_p{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc: the host name alone
        pass
    return f"{host}-{os.getpid()}"


def staging_path(path: str | os.PathLike) -> Path:
    """A fresh staging name beside ``path`` for this writer: ``.NAME.tmp-HOST-PID-HEX``,
    which :func:`remove_stale_staging` removes once this process is gone."""
    final = Path(path).absolute()
    return final.with_name(f".{final.name}.tmp-{_writer_tag()}-{uuid.uuid4().hex[:12]}")


def _writer_alive(tag: str) -> bool:
    """False when ``tag`` names a process on this host that no longer exists."""
    host, _, pid = tag.rpartition("-")
    if host != _writer_tag().rpartition("-")[0] or not pid.isdigit():
        return True  # another host (a shared volume): only its age can tell
    return process_alive(int(pid))


def remove_stale_staging(path: str | os.PathLike, *, now: float | None = None) -> list[Path]:
    """Remove the staging entries that dead writers left in the directory of ``path``, for
    any name in it (a killed ``--out v3`` leaves ``.v3.tmp-*``, which the write of v4
    removes): ``.NAME.tmp-HOST-PID-*`` directories and links, and ``.NAME.old-HOST-PID-*``.

    An entry is stale when its writer was on this host and is gone, or, for ``path``'s own
    name, when it is older than :data:`STALE_STAGING_SECONDS` (a writer on another host
    sharing the volume: only its age can tell); a live writer's entries are left alone. A
    stale ``.NAME.old-*`` whose ``NAME`` is missing is the previous artifact of a writer that
    died between its two renames: it is renamed back to ``NAME``, not removed. Entries that
    cannot be removed (a read-only directory) are left. Returns the paths removed or
    restored."""
    final = Path(path).absolute()
    now = time.time() if now is None else now
    handled = []
    try:
        entries = sorted(final.parent.iterdir())
    except OSError:  # no such directory (yet), or unreadable: nothing to clean
        return handled
    for entry in entries:
        match = _STAGING.fullmatch(entry.name)
        if match is None:
            continue
        try:
            age = now - entry.lstat().st_mtime
        except FileNotFoundError:
            continue
        abandoned = match["name"] == final.name and age > STALE_STAGING_SECONDS
        if not abandoned and _writer_alive(match["tag"]):
            continue
        owner = entry.with_name(match["name"])
        try:
            if match["kind"] == "old" and not owner.exists() and not owner.is_symlink():
                os.rename(entry, owner)  # the previous artifact, back where it was
            elif entry.is_dir() and not entry.is_symlink():
                _remove_replaced(entry)
                if entry.exists():
                    continue
            else:
                entry.unlink()
        except OSError:
            continue
        handled.append(entry)
    return handled


def write_artifact(
    path: str | os.PathLike,
    *,
    projection: np.ndarray,
    offset: np.ndarray,
    embeddings: np.ndarray,
    labels: np.ndarray,
    classes: list,
    mean: np.ndarray,
    scale: np.ndarray,
    default_k: int,
    decision_rule: str = "majority",
    ids: np.ndarray | None = None,
    validation_embeddings: np.ndarray | None = None,
    validation_labels: np.ndarray | None = None,
    index_bytes: bytes | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Validate the pieces of a model and write them atomically as an artifact at ``path``.

    ``metadata`` is merged into the manifest (training config, metrics, data fingerprint...);
    it may not override the keys this module owns. An existing ``path`` must be an artifact
    (or an empty directory): anything else is refused (``ownership.check_replaceable``).
    ``extra_files`` (name -> bytes: a report,
    plots) are written into the same directory before it is renamed into place and listed
    with their sha256 under ``extras``. Returns the artifact path.
    """
    final = Path(path).absolute()
    arrays = _validated_arrays(
        projection=projection,
        offset=offset,
        embeddings=embeddings,
        labels=labels,
        mean=mean,
        scale=scale,
        ids=ids,
        validation_embeddings=validation_embeddings,
        validation_labels=validation_labels,
    )
    manifest = _manifest_fields(arrays, classes, default_k, decision_rule, metadata)
    check_replaceable(final, "the artifact path")  # never replace what we did not write
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(final)
    staging = staging_path(final)
    staging.mkdir()
    try:
        manifest["files"] = _write_model_files(staging, arrays, index_bytes)
        manifest["extras"] = _write_extra_files(staging, extra_files or {})
        # the version hashes the manifest as a reader will parse it (tuples become lists...)
        as_read = json.loads(json.dumps(manifest, allow_nan=False))
        manifest["model_version"] = model_version_of(as_read)
        text = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False)
        _write_bytes_synced(staging / MANIFEST_FILE, text.encode("utf-8"))
        _fsync_dir(staging)
        _move_into_place(staging, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _manifest_fields(arrays, classes, default_k, decision_rule, metadata) -> dict[str, Any]:
    """The manifest without files, extras and version: ``metadata`` (which may not set the
    keys this package owns) and the checked classes, default k and rule, and the shapes."""
    classes_json = check_classes([_to_json_label(c) for c in classes])
    check_arrays(arrays, len(classes_json))
    check_decision_rule(decision_rule)
    d, n_features = arrays["projection"].shape
    n_refs = arrays["embeddings"].shape[0]
    default_k = check_default_k(default_k, n_refs)
    manifest: dict[str, Any] = dict(metadata or {})
    clash = OWNED_MANIFEST_KEYS & set(manifest)
    if clash:
        raise ArtifactError(f"metadata may not set the manifest keys {sorted(clash)}")
    manifest.update(
        {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "n_features_in": int(n_features),
            "n_components": int(d),
            "n_references": int(n_refs),
            "n_validation": len(arrays.get("validation_labels", ())),
            "classes": classes_json,
            "default_k": int(default_k),
            "decision_rule": decision_rule,
            "standardization": STANDARDIZATION_RECORD,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "package_version": __version__,
        }
    )
    check_records(manifest)
    return manifest


def _validated_arrays(
    *, ids, validation_embeddings, validation_labels, **required
) -> dict[str, np.ndarray]:
    """The arrays of an artifact in their file dtypes, with consistent shapes (d, D, N, V),
    at least one reference, and positive scales. Raises ArtifactError naming the file."""
    arrays = {name: _coerce(name, value) for name, value in required.items()}
    if ids is not None:
        arrays["ids"] = _coerce("ids", ids)
    if (validation_embeddings is None) != (validation_labels is None):
        raise ArtifactError("validation_embeddings and validation_labels go together")
    if validation_embeddings is not None:
        arrays["validation_embeddings"] = _coerce("validation_embeddings", validation_embeddings)
        arrays["validation_labels"] = _coerce("validation_labels", validation_labels)
    if arrays["projection"].ndim != 2:
        raise ArtifactError(
            f"projection.npy: expected 2 dimensions (d, D), got shape {arrays['projection'].shape}"
        )
    d, n_features = arrays["projection"].shape
    n_refs = arrays["embeddings"].shape[0] if arrays["embeddings"].ndim == 2 else -1
    n_validation = len(arrays["validation_labels"]) if "validation_labels" in arrays else 0
    dims = {"d": d, "D": n_features, "N": n_refs, "V": n_validation}
    _check_shapes({name: a.shape for name, a in arrays.items()}, dims)
    if n_refs < 1:
        raise ArtifactError("embeddings.npy: an artifact needs at least one reference point")
    return arrays


def _write_model_files(
    staging: Path, arrays: Mapping[str, np.ndarray], index_bytes: bytes | None
) -> dict[str, dict[str, Any]]:
    """Each array as its .npy file (and the index), synced; their manifest ``files`` records
    (path, dtype, shape, sha256; bytes and sha256 for the index)."""
    files: dict[str, dict[str, Any]] = {}
    for name, array in arrays.items():
        file_name = ARRAY_SPECS[name][0]
        data = _npy_bytes(array)
        _write_bytes_synced(staging / file_name, data)
        files[name] = {
            "path": file_name,
            "dtype": array.dtype.str,
            "shape": list(array.shape),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    if index_bytes is not None:
        _write_bytes_synced(staging / INDEX_FILE, index_bytes)
        files["index"] = {
            "path": INDEX_FILE,
            "bytes": len(index_bytes),
            "sha256": hashlib.sha256(index_bytes).hexdigest(),
        }
    return files


def _write_extra_files(
    staging: Path, extra_files: Mapping[str, bytes]
) -> dict[str, dict[str, Any]]:
    """Extra files (report, plots) under plain names that no model file uses; their
    manifest ``extras`` records (bytes, sha256)."""
    extras: dict[str, dict[str, Any]] = {}
    reserved = {spec[0] for spec in ARRAY_SPECS.values()} | {MANIFEST_FILE, INDEX_FILE}
    for name, data in extra_files.items():
        if name in reserved or Path(name).name != name or name.startswith("."):
            raise ArtifactError(f"extra file name {name!r} is reserved or not a plain file name")
        _write_bytes_synced(staging / name, data)
        extras[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return extras


def _check_shapes(shapes: Mapping[str, tuple[int, ...]], dims: Mapping[str, int]) -> None:
    for name, shape in shapes.items():
        file_name, _, symbols = ARRAY_SPECS[name]
        expected = tuple(dims[s] for s in symbols)
        if tuple(shape) != expected:
            described = ", ".join(f"{s}={dims[s]}" for s in symbols)
            raise ArtifactError(
                f"{file_name}: expected shape {expected} ({described}), got {tuple(shape)}"
            )


def rewrite_artifact(
    artifact: Artifact,
    path: str | os.PathLike,
    *,
    index_bytes: bytes | None,
    metadata: Mapping[str, Any],
) -> Path:
    """Write ``artifact`` again at ``path`` (atomically, as ``write_artifact`` does) with
    another prebuilt index and ``metadata`` merged over its manifest's own."""
    kept = {k: v for k, v in artifact.manifest.items() if k not in OWNED_MANIFEST_KEYS}
    explicit_ids = "ids" in artifact.manifest["files"]
    return write_artifact(
        path,
        projection=artifact.projection,
        offset=artifact.offset,
        embeddings=artifact.embeddings,
        labels=artifact.labels,
        classes=artifact.classes,
        mean=artifact.mean,
        scale=artifact.scale,
        default_k=artifact.default_k,
        decision_rule=artifact.decision_rule,
        ids=artifact.ids if explicit_ids else None,
        validation_embeddings=artifact.validation_embeddings,
        validation_labels=artifact.validation_labels,
        index_bytes=index_bytes,
        extra_files=read_extras(artifact),
        metadata={**kept, **metadata},
    )
