"""The model artifact: the one definition of what training writes and the service reads.

An artifact is a directory::

    manifest.json      schema version, shapes, classes, decision rule, training record,
                       metrics, and for every array file its shape, dtype and sha256
    projection.npy     W, float32 (d, D)   } z = x @ W.T + b maps a raw input x (D,)
    offset.npy         b, float32 (d,)     } to its embedding z (d,), standardisation included
    embeddings.npy     float32 (N, d)      the reference (training) points, already projected
    labels.npy         int32 (N,)          indices into manifest["classes"]
    mean.npy           float64 (D,)        the input standardisation, x_std = (x - mean) / scale,
    scale.npy          float64 (D,)        kept so a later job can warm-start from A = W * scale
    ids.npy            int64 (N,)          optional reference ids (default: 0..N-1)
    validation_embeddings.npy  float32 (V, d)  optional: the training job's held-out validation
    validation_labels.npy      int32 (V,)      split, projected; tunes approximate indexes
    index.faiss        optional prebuilt FAISS index (bytes; checksummed, not interpreted here)

Writing is atomic: everything goes to a temporary sibling directory, each file and the
directory are fsynced, then the directory is renamed into place (an existing artifact at
that path is exchanged in one step where the OS allows it). A reader never sees half an
artifact and a crash leaves the previous one intact.

Reading pins the directory (one directory file descriptor; every file is opened relative to
it), reads each file exactly once into memory, verifies its sha256 on those bytes and parses
the same bytes: what was verified is what is served, even if the path is repointed or the
directory exchanged while it is read. It checks everything else too (the model version
against the files, shapes, dtypes, label range) and raises :class:`ArtifactError` naming the
file, the expected and the actual value.

A writer killed between creating its staging directory and renaming it leaves a
``.NAME.tmp-HOST-PID-*`` sibling behind; the next write to the same path removes those whose
writer is gone (same host, dead process) or that are older than a day.

This module imports numpy and the standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime as _dt
import errno
import hashlib
import io
import itertools
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service import __version__
from service.core.vocabulary import NEIGHBOUR_RULES

SCHEMA_VERSION = 1
FORMAT_NAME = "nca-knn-artifact"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"
DECISION_RULES = NEIGHBOUR_RULES  # a default rule needs nothing but the neighbours

# name -> (file name, dtype, symbolic shape). Symbols: d components, D features, N references.
ARRAY_SPECS: dict[str, tuple[str, np.dtype, tuple[str, ...]]] = {
    "projection": ("projection.npy", np.dtype(np.float32), ("d", "D")),
    "offset": ("offset.npy", np.dtype(np.float32), ("d",)),
    "embeddings": ("embeddings.npy", np.dtype(np.float32), ("N", "d")),
    "labels": ("labels.npy", np.dtype(np.int32), ("N",)),
    "mean": ("mean.npy", np.dtype(np.float64), ("D",)),
    "scale": ("scale.npy", np.dtype(np.float64), ("D",)),
    "ids": ("ids.npy", np.dtype(np.int64), ("N",)),
    "validation_embeddings": ("validation_embeddings.npy", np.dtype(np.float32), ("V", "d")),
    "validation_labels": ("validation_labels.npy", np.dtype(np.int32), ("V",)),
}
OPTIONAL_ARRAYS = frozenset({"ids", "validation_embeddings", "validation_labels"})
REQUIRED_MANIFEST_KEYS = (
    "format",
    "schema_version",
    "n_features_in",
    "n_components",
    "n_references",
    "classes",
    "default_k",
    "decision_rule",
    "files",
    "created_at",
    "package_version",
)
# written by write_artifact itself; metadata may not set them
OWNED_MANIFEST_KEYS = frozenset(REQUIRED_MANIFEST_KEYS) | {
    "model_version",
    "standardization",
    "extras",
    "n_validation",
}


# manifest fields that describe a model without changing any answer it gives; every other
# field is part of the model version (model_version_of)
DESCRIPTIVE_MANIFEST_KEYS = frozenset(
    {
        "model_version",
        "files",  # hashed by the sha256 of each file instead
        "created_at",
        "package_version",
        "extras",  # the report and plots
        "data",  # the training data's fingerprint and sizes
        "metrics",
        "training",
        "lineage",
    }
)


class ArtifactError(ValueError):
    """An artifact is missing, malformed, corrupted or inconsistent."""


@dataclass(frozen=True)
class Artifact:
    """A loaded, validated artifact. Arrays may be read-only memory maps."""

    path: Path
    manifest: dict[str, Any]
    projection: np.ndarray  # (d, D) float32
    offset: np.ndarray  # (d,) float32
    embeddings: np.ndarray  # (N, d) float32
    labels: np.ndarray  # (N,) int32, indices into classes
    mean: np.ndarray  # (D,) float64
    scale: np.ndarray  # (D,) float64
    ids: np.ndarray  # (N,) int64
    index_bytes: bytes | None = field(default=None, repr=False)  # verified index.faiss
    validation_embeddings: np.ndarray | None = None  # (V, d) float32, held out in training
    validation_labels: np.ndarray | None = None  # (V,) int32

    @property
    def classes(self) -> list:
        return list(self.manifest["classes"])

    @property
    def n_features_in(self) -> int:
        return int(self.manifest["n_features_in"])

    @property
    def n_components(self) -> int:
        return int(self.manifest["n_components"])

    @property
    def default_k(self) -> int:
        return int(self.manifest["default_k"])

    @property
    def decision_rule(self) -> str:
        return str(self.manifest["decision_rule"])

    @property
    def outlier_calibration(self) -> dict | None:
        """The manifest's ``outlier_calibration`` (``training.outliers.calibrate``), checked:
        ``quantiles`` maps q in (0, 1) (as a string) to the q-quantile of held-out points'
        squared distance to their nearest reference, at least two of them, non-decreasing in
        q and finite. None when the model was trained without a validation split."""
        return parse_outlier_calibration(self.manifest.get("outlier_calibration"))

    @property
    def version(self) -> str:
        """A short content hash naming everything that can change this model's answers
        (``model_version_of``): the arrays, the index and every field but the descriptive
        ones. Computed when the artifact is read."""
        return str(self.manifest["model_version"])

    def components_in_standardized_space(self) -> np.ndarray:
        """A (d, D) with W = A / scale, i.e. the map learned on standardised inputs."""
        return np.asarray(self.projection, dtype=np.float64) * self.scale[None, :]


# --------------------------------------------------------------------------- writing


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
    if isinstance(label, np.generic):
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise ArtifactError(
            f"class labels must be integers or strings, got {label!r} ({type(label).__name__})"
        )
    return label


def _coerce(name: str, array: Any) -> np.ndarray:
    file_name, dtype, _ = ARRAY_SPECS[name]
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
        raise ArtifactError(f"{file_name}: expected a numeric array, got dtype {array.dtype}")
    if not np.all(np.isfinite(array)):
        raise ArtifactError(f"{file_name}: contains NaN or Inf")
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
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old artifact
        return
    # Portable fallback: move the old one aside, move the new one in, restore on failure.
    backup = final.with_name(f".{final.name}.old-{_writer_tag()}-{uuid.uuid4().hex[:8]}")
    os.rename(final, backup)
    try:
        os.rename(staging, final)
    except BaseException:
        os.rename(backup, final)
        raise
    shutil.rmtree(backup, ignore_errors=True)


STALE_STAGING_SECONDS = 24 * 3600  # a staging directory this old is abandoned on any host


def _writer_tag() -> str:
    """HOST-PID of this writer, so that a later writer can tell whether it is still alive."""
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def _writer_alive(tag: str) -> bool:
    """False when ``tag`` names a process on this host that no longer exists."""
    host, _, pid = tag.rpartition("-")
    if host != _writer_tag().rpartition("-")[0] or not pid.isdigit():
        return True  # another host (a shared volume): only its age can tell
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(path: str | os.PathLike, *, now: float | None = None) -> list[Path]:
    """Remove ``.NAME.tmp-*`` / ``.NAME.old-*`` siblings of ``path`` left by dead writers.

    A sibling is stale when its writer was on this host and is gone, or when it is older
    than :data:`STALE_STAGING_SECONDS`. Returns the removed paths.
    """
    final = Path(path).absolute()
    now = time.time() if now is None else now
    removed = []
    for prefix in (f".{final.name}.tmp-", f".{final.name}.old-"):
        for sibling in final.parent.glob(glob_escape(prefix) + "*"):
            tag = sibling.name[len(prefix) :].rpartition("-")[0]
            try:
                age = now - sibling.lstat().st_mtime
            except FileNotFoundError:
                continue
            if age > STALE_STAGING_SECONDS or not _writer_alive(tag):
                shutil.rmtree(sibling, ignore_errors=True)
                removed.append(sibling)
    return removed


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


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
    it may not override the keys this module owns. ``extra_files`` (name -> bytes: a report,
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
    classes_json = _validated_classes(classes, arrays)
    if decision_rule not in DECISION_RULES:
        raise ArtifactError(f"decision_rule must be one of {DECISION_RULES}, got {decision_rule!r}")
    d, n_features = arrays["projection"].shape
    n_refs = arrays["embeddings"].shape[0]
    if not (isinstance(default_k, (int, np.integer)) and 1 <= int(default_k) <= n_refs):
        raise ArtifactError(f"default_k must be an integer in [1, {n_refs}], got {default_k!r}")
    manifest: dict[str, Any] = dict(metadata or {})
    clash = OWNED_MANIFEST_KEYS & set(manifest)
    if clash:
        raise ArtifactError(f"metadata may not set the manifest keys {sorted(clash)}")

    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(final)
    staging = final.with_name(f".{final.name}.tmp-{_writer_tag()}-{uuid.uuid4().hex[:12]}")
    staging.mkdir()
    try:
        files = _write_model_files(staging, arrays, index_bytes)
        extras = _write_extra_files(staging, extra_files or {})
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
                "files": files,
                "extras": extras,
            }
        )
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


STANDARDIZATION_RECORD = {
    "method": "standard",
    "formula": "z = x @ projection.T + offset = ((x - mean) / scale) @ A.T",
    "mean_file": ARRAY_SPECS["mean"][0],
    "scale_file": ARRAY_SPECS["scale"][0],
}


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
    if np.any(arrays["scale"] <= 0):
        raise ArtifactError("scale.npy: every standardisation scale must be > 0")
    return arrays


def _validated_classes(classes: list, arrays: Mapping[str, np.ndarray]) -> list:
    """The classes as JSON values (distinct integers or strings); every label index in
    ``arrays`` must point into them."""
    classes_json = [_to_json_label(c) for c in classes]
    if len(set(classes_json)) != len(classes_json):
        raise ArtifactError(f"classes must be distinct, got {classes_json!r}")
    for name in ("labels", "validation_labels"):
        found = arrays.get(name)
        if (
            found is not None
            and found.size
            and (found.min() < 0 or found.max() >= len(classes_json))
        ):
            raise ArtifactError(
                f"{name}.npy: label indices must lie in [0, {len(classes_json)}), got range "
                f"[{found.min()}, {found.max()}]"
            )
    return classes_json


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


# --------------------------------------------------------------------------- reading


class _PinnedDirectory:
    """An artifact directory held open by one file descriptor; files are opened relative to
    it, so repointing a symlink or exchanging the directory cannot mix two artifacts."""

    def __init__(self, root: Path):
        self.root = root
        try:
            self.fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except (FileNotFoundError, NotADirectoryError):
            raise ArtifactError(f"{root}: no artifact directory there") from None
        except OSError as exc:
            raise ArtifactError(f"{root}: cannot be opened ({exc.strerror})") from None

    def __enter__(self) -> _PinnedDirectory:
        return self

    def __exit__(self, *exc_info) -> None:
        os.close(self.fd)

    def read(self, name: str, what: str) -> bytes:
        """The whole file ``name`` inside the directory, read once."""
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ArtifactError(
                f"{self.root / MANIFEST_FILE}: {what} path {name!r} is not a plain file name"
            )
        try:
            fd = os.open(name, os.O_RDONLY, dir_fd=self.fd)
        except FileNotFoundError:
            raise ArtifactError(f"{self.root / name}: missing ({what})") from None
        except OSError as exc:
            raise ArtifactError(f"{self.root / name}: cannot be opened ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()


def _parse_manifest(root: Path, data: bytes) -> dict[str, Any]:
    manifest_path = root / MANIFEST_FILE
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{manifest_path}: not valid JSON ({exc})") from exc
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
    if manifest["decision_rule"] not in DECISION_RULES:
        raise ArtifactError(
            f"{manifest_path}: decision_rule is {manifest['decision_rule']!r}, "
            f"expected one of {DECISION_RULES}"
        )
    if not isinstance(manifest["files"], dict):
        raise ArtifactError(f"{manifest_path}: 'files' must be an object")
    try:
        parse_outlier_calibration(manifest.get("outlier_calibration"))
    except ArtifactError as exc:
        raise ArtifactError(f"{manifest_path}: {exc}") from None
    return manifest


def parse_outlier_calibration(record: Any) -> dict | None:
    """``outlier_calibration`` checked (see ``Artifact.outlier_calibration``), with its
    quantiles as a sorted {float q: float distance}; ArtifactError naming what is wrong."""
    if record is None:
        return None
    where = "manifest outlier_calibration"
    if not isinstance(record, dict) or not isinstance(record.get("quantiles"), dict):
        raise ArtifactError(f"{where}: expected an object with a 'quantiles' object")
    quantiles: dict[float, float] = {}
    for key, value in record["quantiles"].items():
        try:
            q = float(key)
        except ValueError:
            raise ArtifactError(f"{where}: quantile {key!r} is not a number") from None
        if not 0.0 < q < 1.0 or isinstance(value, bool) or not isinstance(value, int | float):
            raise ArtifactError(
                f"{where}: quantile {key!r}: {value!r}; expected q in (0, 1) and a number"
            )
        if not np.isfinite(value) or value < 0:
            raise ArtifactError(f"{where}: quantile {key!r} is {value!r}, expected finite >= 0")
        quantiles[q] = float(value)
    qs = sorted(quantiles)
    if len(qs) < 2:
        raise ArtifactError(f"{where}: needs at least two quantiles, got {len(qs)}")
    values = [quantiles[q] for q in qs]
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ArtifactError(f"{where}: the distances must not decrease with q, got {values}")
    return {**record, "quantiles": {q: quantiles[q] for q in qs}}


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check manifest.json of the artifact at ``path`` (no array is opened)."""
    root = Path(path)
    with _PinnedDirectory(root) as directory:
        return _parse_manifest(root, directory.read(MANIFEST_FILE, "the manifest"))


def model_version_of(manifest: Mapping[str, Any]) -> str:
    """The model version: a hash of everything in the artifact that can change an answer.

    That is the array files' sha256s in :data:`ARRAY_SPECS` order, then the prebuilt index's
    (an approximate index changes answers), then every manifest field except the
    :data:`DESCRIPTIVE_MANIFEST_KEYS` as canonical JSON (sorted keys, no whitespace): the
    classes, the default k and decision rule, the outlier calibration, the index's tuned
    search parameters, the shapes, and any field a later writer adds. Two artifacts with
    the same version answer every inference request identically; a field that only
    describes the model (training record, metrics, lineage, timestamps) leaves it unchanged.
    """
    files = manifest["files"]
    digest = hashlib.sha256()
    for name in (*ARRAY_SPECS, "index"):
        if name in files:
            digest.update(str(files[name]["sha256"]).encode())
    answering = {k: v for k, v in manifest.items() if k not in DESCRIPTIVE_MANIFEST_KEYS}
    digest.update(b"\0manifest\0")
    digest.update(json.dumps(answering, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()[:16]


def legacy_model_version_of(files: Mapping[str, Mapping[str, Any]]) -> str:
    """The version nca-knn 0.1 artifacts were written with (the array and index files
    only); still accepted as the stored version of an older artifact, which is then served
    under its full :func:`model_version_of`."""
    digest = hashlib.sha256()
    for name in (*ARRAY_SPECS, "index"):
        if name in files:
            digest.update(str(files[name]["sha256"]).encode())
    return digest.hexdigest()[:16]


def _parse_npy(file_path: Path, data: bytes) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ArtifactError(f"{file_path}: cannot be read as .npy ({exc})") from exc


def read_artifact(path: str | os.PathLike) -> Artifact:
    """Load the artifact at ``path``, verifying checksums, dtypes, shapes and consistency.

    Each file is read once, through a descriptor of the directory opened first; the bytes
    whose sha256 is checked are the bytes that are parsed.
    """
    root = Path(path)
    with _PinnedDirectory(root) as directory:
        manifest = _parse_manifest(root, directory.read(MANIFEST_FILE, "the manifest"))
        files = manifest["files"]
        dims = {
            "d": int(manifest["n_components"]),
            "D": int(manifest["n_features_in"]),
            "N": int(manifest["n_references"]),
            "V": int(manifest.get("n_validation", 0)),
        }
        arrays: dict[str, np.ndarray] = {}
        for name, (file_name, dtype, symbols) in ARRAY_SPECS.items():
            entry = files.get(name)
            if entry is None:
                if name in OPTIONAL_ARRAYS:
                    continue
                raise ArtifactError(
                    f"{root / MANIFEST_FILE}: no entry for required file {file_name}"
                )
            data = directory.read(entry.get("path"), f"listed in the manifest as {name}")
            file_path = root / entry["path"]
            _check_sha256(file_path, data, entry.get("sha256"))
            array = _parse_npy(file_path, data)
            if array.dtype != dtype:
                raise ArtifactError(f"{file_path}: expected dtype {dtype}, got {array.dtype}")
            expected = tuple(dims[s] for s in symbols)
            if array.shape != expected or list(array.shape) != list(entry.get("shape", [])):
                raise ArtifactError(
                    f"{file_path}: expected shape {expected}, got {array.shape} "
                    f"(manifest says {tuple(entry.get('shape', ()))})"
                )
            arrays[name] = array
        index_bytes = None
        if "index" in files:
            entry = files["index"]
            index_bytes = directory.read(entry.get("path"), "listed in the manifest as index")
            _check_sha256(root / entry["path"], index_bytes, entry.get("sha256"))
    expected_version = model_version_of(manifest)
    stored = manifest.get("model_version", expected_version)
    if stored not in (expected_version, legacy_model_version_of(files)):
        raise ArtifactError(
            f"{root / MANIFEST_FILE}: model_version is {stored!r} but the files and fields it "
            f"lists hash to {expected_version!r} (a manifest from another artifact, or edited)"
        )
    manifest = {**manifest, "model_version": expected_version}
    classes = manifest["classes"]
    for name in ("labels", "validation_labels"):
        labels = arrays.get(name)
        if (
            labels is not None
            and labels.size
            and (labels.min() < 0 or labels.max() >= len(classes))
        ):
            raise ArtifactError(
                f"{root / ARRAY_SPECS[name][0]}: label indices must lie in [0, {len(classes)})"
            )
    if ("validation_embeddings" in arrays) != ("validation_labels" in arrays):
        raise ArtifactError(
            f"{root / MANIFEST_FILE}: validation_embeddings and validation_labels go together"
        )
    if "ids" not in arrays:
        arrays["ids"] = np.arange(dims["N"], dtype=np.int64)
    return Artifact(path=root, manifest=manifest, index_bytes=index_bytes, **arrays)


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
    mtime, inode) of every file it lists. It changes when the artifact is replaced, repointed,
    rewritten or healed, so a poller can retry a failed version once it changes."""
    root = Path(path)
    try:
        with _PinnedDirectory(root) as directory:
            manifest_bytes = directory.read(MANIFEST_FILE, "the manifest")
            identity = os.fstat(directory.fd)
            stats = []
            try:
                files = json.loads(manifest_bytes.decode("utf-8")).get("files", {})
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                files = {}
            for name in sorted(files) if isinstance(files, dict) else ():
                entry = files[name]
                file_name = entry.get("path") if isinstance(entry, dict) else None
                try:
                    st = os.stat(str(file_name), dir_fd=directory.fd)
                    stats.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
                except (OSError, TypeError, ValueError):
                    stats.append((name, None, None, None))
    except ArtifactError:
        return None
    return (
        identity.st_dev,
        identity.st_ino,
        hashlib.sha256(manifest_bytes).hexdigest(),
        tuple(stats),
    )


def read_extras(artifact: Artifact) -> dict[str, bytes]:
    """The extra files (report, plots) an artifact lists, each verified against its sha256."""
    out: dict[str, bytes] = {}
    with _PinnedDirectory(artifact.path) as directory:
        for name, entry in artifact.manifest.get("extras", {}).items():
            data = directory.read(name, "listed in the manifest as an extra file")
            _check_sha256(artifact.path / name, data, entry.get("sha256"))
            out[name] = data
    return out


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
