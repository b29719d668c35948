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

* ``format.py``: the file names, dtypes, shapes and manifest keys, the ``Artifact`` a reader
  gets, and the model version (a hash of everything that can change an answer).
* ``read.py``: the pinned read: each file read once, its sha256 checked on the bytes that are
  parsed; every check names the file, the expected and the actual value.
* ``ownership.py``: what a writer may replace (nothing it did not write) and the lock that
  makes writers of one path take turns.
* ``write.py``: the atomic write: a staging sibling, fsynced, renamed into place.

Tests: ``tests/service/core/test_artifact.py``, ``test_version_identity.py``, ``tests/service/engine/test_robustness.py``.
numpy and the standard library only.
"""

from service.core.artifact.format import (
    ARRAY_SPECS,
    DECISION_RULES,
    DESCRIPTIVE_MANIFEST_KEYS,
    FORMAT_NAME,
    INDEX_FILE,
    MANIFEST_FILE,
    OPTIONAL_ARRAYS,
    OWNED_MANIFEST_KEYS,
    REQUIRED_MANIFEST_KEYS,
    SCHEMA_VERSION,
    STANDARDIZATION_RECORD,
    Artifact,
    ArtifactError,
    legacy_model_version_of,
    model_version_of,
    parse_outlier_calibration,
)
from service.core.artifact.ownership import (
    OutputClaim,
    WriterLockTimeout,
    check_replaceable,
    check_writable,
    version_at,
    writer_lock,
)
from service.core.artifact.read import (
    artifact_fingerprint,
    read_artifact,
    read_extras,
    read_manifest,
)
from service.core.artifact.write import remove_stale_staging, rewrite_artifact, write_artifact

__all__ = [
    "ARRAY_SPECS",
    "DECISION_RULES",
    "DESCRIPTIVE_MANIFEST_KEYS",
    "FORMAT_NAME",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "OPTIONAL_ARRAYS",
    "OWNED_MANIFEST_KEYS",
    "REQUIRED_MANIFEST_KEYS",
    "SCHEMA_VERSION",
    "STANDARDIZATION_RECORD",
    "Artifact",
    "ArtifactError",
    "OutputClaim",
    "WriterLockTimeout",
    "artifact_fingerprint",
    "check_replaceable",
    "check_writable",
    "legacy_model_version_of",
    "model_version_of",
    "parse_outlier_calibration",
    "read_artifact",
    "read_extras",
    "read_manifest",
    "remove_stale_staging",
    "rewrite_artifact",
    "version_at",
    "write_artifact",
    "writer_lock",
]
