"""The reference set as data: add and remove references of a trained model, no retraining.

kNN is non-parametric: new labelled points improve its answers as soon as they are among the
references, and a point deleted on request must stop appearing in any answer. Every change
writes a new artifact version (``service.core.artifact.write_artifact``: atomic, checksummed),
which the service picks up by reload or its poller, so replicas never disagree and a crash
leaves the previous version whole. The map A, the standardisation, the validation split and
the training record are the parent's; what changed is recorded in the manifest's
``lineage`` (one entry per operation, oldest first: operation, parent version, row counts,
time, warnings), which ``GET /v1/model`` shows.

* add: the new rows are projected with the artifact's own map (``service.core.knn.project``, the
  function the service runs on queries) and appended with their labels and ids. Ids are
  given (distinct int64, none already used) or assigned after the current maximum. A label
  the map was never trained on is accepted with a warning recorded in the lineage, and the
  class list grows.
* remove: the rows with the given ids are dropped; unknown ids are an error that lists them.
  Removing every reference of a class is allowed and recorded. When fewer references remain
  than the default k, the default k comes down to their number (recorded).

* condense: keep a subset (Hart's condensing, after Wilson editing with ``edit_k``), or
  replace the references by round(N / reduction) prototypes shared among the classes (method
  "prototypes"; reduction defaults to 20, 5% kept), starting at per-class k-means centres.
  ``refine`` "nca" (the default) learns them with NCA's objective and the map fixed
  (``training.references.learned``, at most ``refine_epochs`` L-BFGS iterations, 200);
  "none" keeps the cluster means.
  Prototypes are not training rows: each carries the id of the training row of its class
  nearest it, and the manifest's ``reference_set`` says what the references are. With
  "nca" the default k becomes the one the prototypes serve best on the validation split
  (recorded in the lineage; usually 1).

A prebuilt FAISS index of the parent no longer matches the references and is not carried
over: the service builds its index at load. Bad input raises :class:`ReferenceError` (the CLI
exits 2) and writes nothing; a write the file system refuses (full, read-only, over the
file-size limit) raises ``training.errors.WriteError`` and replaces nothing.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import numpy as np

from service.core.artifact import (
    OWNED_MANIFEST_KEYS,
    Artifact,
    ArtifactError,
    read_artifact,
    read_extras,
    write_artifact,
)
from service.core.knn import project
from training.data.datasets import DataError, validate_xy
from training.errors import Interrupted, WriteError, holding_interrupts
from training.evaluation.calibration import calibrate
from training.evaluation.evaluate import knn_accuracies
from training.references.checkpoint import remove_checkpoints
from training.references.compress import compress, edit_k_for, reference_set_record
from training.references.condense import budget_record, condense, prototypes
from training.references.learned import LOSSES, check_budget, representatives


class ReferenceError(ValueError):
    """A reference-set change cannot be made; the message says what and why."""


def read_parent(model: str | Path) -> Artifact:
    try:
        return read_artifact(model)
    except ArtifactError as exc:
        raise ReferenceError(f"--model {str(model)!r} is not a readable artifact: {exc}") from exc


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _checked_ids(ids, n: int, what: str) -> np.ndarray:
    """ids as int64 (n,): integers only (no floats, no strings), distinct."""
    array = np.asarray(ids)
    if array.ndim != 1 or len(array) != n:
        raise ReferenceError(f"{what}: expected {n} ids in a 1-D array, got shape {array.shape}")
    if array.dtype.kind not in "iu" or (
        array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max
    ):
        raise ReferenceError(f"{what}: ids must be int64 integers, got dtype {array.dtype}")
    array = array.astype(np.int64)
    values, counts = np.unique(array, return_counts=True)
    if (counts > 1).any():
        raise ReferenceError(f"{what}: duplicate ids {values[counts > 1][:10].tolist()}")
    return array


def _checked_rows(parent: Artifact, X, y) -> tuple[np.ndarray, np.ndarray]:
    """Rows (n, D) and labels (n,) given with --data, checked as the training job checks
    data, with D the model's."""
    try:
        X, y = validate_xy(X, y, what="--data")
    except DataError as exc:
        raise ReferenceError(str(exc)) from exc
    if X.shape[1] != parent.n_features_in:
        raise ReferenceError(
            f"--data has {X.shape[1]} features, the model expects {parent.n_features_in}"
        )
    return X, y


def _default_k_for(parent: Artifact, n_after: int, entry: dict, k: int | None = None) -> int:
    """``k`` (the parent's default k when None), lowered to the number of references left
    when fewer remain (recorded in the lineage entry)."""
    k = parent.default_k if k is None else k
    if n_after < k:
        entry["default_k_lowered"] = [k, n_after]
        return n_after
    return k


def write_version(
    parent: Artifact,
    out: str | Path,
    *,
    embeddings: np.ndarray,
    labels: np.ndarray,
    ids: np.ndarray,
    classes: list,
    entry: dict,
    default_k: int | None = None,
    reference_set: dict | None = None,
) -> Path:
    """The parent with another reference set, written atomically at ``out``; ``entry`` (the
    operation and its counts) is appended to the lineage with the parent's version and the
    time."""
    kept = {k: v for k, v in parent.manifest.items() if k not in OWNED_MANIFEST_KEYS}
    if parent.validation_embeddings is not None and len(parent.validation_embeddings):
        # "far" is measured against the references: recalibrate on the new set
        kept["outlier_calibration"] = calibrate(embeddings, parent.validation_embeddings)
    if reference_set is not None:
        kept["reference_set"] = reference_set
    lineage = [
        *parent.manifest.get("lineage", []),
        {**entry, "parent_version": parent.version, "at": _now()},
    ]
    try:
        # a first SIGINT / SIGTERM waits for the write's end, then says it was written
        with holding_interrupts(None) as hold:
            path = write_artifact(
                out,
                projection=parent.projection,
                offset=parent.offset,
                embeddings=embeddings,
                labels=labels,
                classes=classes,
                mean=parent.mean,
                scale=parent.scale,
                default_k=parent.default_k if default_k is None else default_k,
                decision_rule=parent.decision_rule,
                ids=ids,
                validation_embeddings=parent.validation_embeddings,
                validation_labels=parent.validation_labels,
                index_bytes=None,
                extra_files=read_extras(parent),
                metadata={**kept, "lineage": lineage},
            )
    except ArtifactError as exc:
        raise ReferenceError(f"cannot write {out}: {exc}") from exc
    except OSError as exc:  # a full or read-only disk, the file-size limit: nothing replaced
        raise WriteError("the artifact", out, exc) from exc
    if hold.signum is not None:  # the version is written whole: the command stops here
        interrupted = Interrupted(hold.signum)
        interrupted.written = str(path)
        raise interrupted
    return path


def add_references(
    model: str | Path,
    X: np.ndarray,
    y: np.ndarray,
    *,
    out: str | Path,
    ids=None,
) -> dict:
    """Append rows X (n, D) with labels y (n,) to the model's references; write ``out``.

    Returns a summary: rows before / added / after, the ids given to the new rows (first and
    last), new classes and warnings."""
    parent = read_parent(model)
    X, y = _checked_rows(parent, X, y)
    if len(X) == 0:
        raise ReferenceError("--data has no rows to add")
    classes = list(parent.classes)
    kinds = {type(c) for c in classes}
    new_labels = [v for v in dict.fromkeys(y.tolist()) if v not in classes]
    if any(type(v) not in kinds for v in new_labels) and classes:
        raise ReferenceError(
            f"labels {new_labels[:10]} are not of the model's label type "
            f"({', '.join(sorted(k.__name__ for k in kinds))}: {classes[:5]}...)"
        )
    classes.extend(new_labels)
    index_of = {c: i for i, c in enumerate(classes)}
    new_idx = np.array([index_of[v] for v in y.tolist()], dtype=np.int32)

    n_before = len(parent.ids)
    if ids is None:
        start = int(parent.ids.max()) + 1 if n_before else 0
        if start + len(X) - 1 > np.iinfo(np.int64).max:
            raise ReferenceError(
                f"the model's largest id is {start - 1}: the {len(X)} new rows' ids, which "
                "follow it, would pass int64's maximum; give them ids of their own with --ids"
            )
        new_ids = np.arange(start, start + len(X), dtype=np.int64)
    else:
        new_ids = _checked_ids(ids, len(X), "--ids")
        taken = np.intersect1d(new_ids, parent.ids)
        if taken.size:
            raise ReferenceError(
                f"--ids: {taken.size} ids are already references of the model, e.g. "
                f"{taken[:10].tolist()}"
            )
    entry = {"operation": "add", "rows_before": n_before, "rows_added": len(X)}
    entry["rows_after"] = n_before + len(X)
    if new_labels:
        entry["new_classes"] = new_labels
        entry["warning"] = (
            f"labels {new_labels} were not among the classes the map was trained on: their "
            "references are placed by a map that never saw them"
        )
    z = project(X, parent.projection, parent.offset)  # (n, d), as the service embeds queries
    path = write_version(
        parent,
        out,
        embeddings=np.concatenate([parent.embeddings, z]),
        labels=np.concatenate([parent.labels, new_idx]),
        ids=np.concatenate([parent.ids, new_ids]),
        classes=classes,
        entry=entry,
    )
    return {**entry, "artifact": str(path), "ids": [int(new_ids[0]), int(new_ids[-1])]}


def remove_references(model: str | Path, ids, *, out: str | Path) -> dict:
    """Drop the references with ``ids`` (distinct int64) from the model; write ``out``."""
    parent = read_parent(model)
    array = np.asarray(ids)
    drop = _checked_ids(array, len(array), "--ids")
    if len(drop) == 0:
        raise ReferenceError("--ids: no ids to remove")
    unknown = np.setdiff1d(drop, parent.ids)
    if unknown.size:
        raise ReferenceError(
            f"--ids: {unknown.size} ids are not references of the model: {unknown[:20].tolist()}"
            + (" ..." if unknown.size > 20 else "")
        )
    keep = ~np.isin(parent.ids, drop)
    n_after = int(keep.sum())
    if n_after == 0:
        raise ReferenceError(
            "--ids: removing every reference would leave the model nothing to answer from"
        )
    classes = parent.classes
    before = np.bincount(parent.labels, minlength=len(classes))
    after = np.bincount(parent.labels[keep], minlength=len(classes))
    entry = {
        "operation": "remove",
        "rows_before": len(parent.ids),
        "rows_removed": len(drop),
        "rows_after": n_after,
    }
    emptied = [classes[i] for i in np.flatnonzero((before > 0) & (after == 0))]
    if emptied:
        entry["classes_emptied"] = emptied
    default_k = _default_k_for(parent, n_after, entry)
    path = write_version(
        parent,
        out,
        embeddings=parent.embeddings[keep],
        labels=parent.labels[keep],
        ids=parent.ids[keep],
        classes=classes,
        entry=entry,
        default_k=default_k,
    )
    return {**entry, "artifact": str(path)}


CONDENSE_METHODS = {
    "hart": "k-NN condensing (Hart)",
    "wilson+hart": "Wilson editing then k-NN condensing",
    "prototypes-nca": "per-class k-means prototypes learned with NCA's objective, the map fixed "
    "(embeddings are prototypes, not references; each id is the training row of its class "
    "nearest it)",
    "prototypes-none": "per-class k-means prototypes, the cluster means (each id is the member "
    "of its cluster nearest it)",
}
PROTOTYPE_REFINERS = ("nca", "none")
DEFAULT_REDUCTION = 20.0  # 5% of the rows kept
DEFAULT_REFINE_EPOCHS = {"nca": 200, "none": 0}


def _is_prototypes(parent: Artifact) -> bool:
    return (parent.manifest.get("reference_set") or {}).get("kind") == "prototypes"


def _whole(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _prototype_settings(parent, reduction, refine, refine_epochs, seed, min_per_class=1) -> dict:
    if refine not in PROTOTYPE_REFINERS:
        raise ReferenceError(
            f"--refine must be one of {', '.join(PROTOTYPE_REFINERS)}; got {refine!r}"
        )

    reduction = DEFAULT_REDUCTION if reduction is None else reduction
    if _is_prototypes(parent):  # checked against the training rows when they were learned
        reduction = float(reduction) if isinstance(reduction, int | float) else reduction
    else:
        try:
            reduction = check_budget(parent.labels, len(parent.classes), reduction, parent.classes)
        except ValueError as exc:
            raise ReferenceError(str(exc)) from None
    refine_epochs = DEFAULT_REFINE_EPOCHS[refine] if refine_epochs is None else refine_epochs
    if not _whole(refine_epochs) or refine_epochs < 0:
        raise ReferenceError(f"--refine-epochs must be an integer >= 0, got {refine_epochs!r}")
    if not _whole(min_per_class) or min_per_class < 1:
        raise ReferenceError(f"--min-per-class must be an integer >= 1, got {min_per_class!r}")
    settings = {
        "method": "prototypes",
        "refine": refine,
        "reduction": reduction,
        "refine_epochs": int(refine_epochs),
        "seed": int(seed),
    }
    if min_per_class != 1:  # the default leaves the record as it was
        settings["min_per_class"] = int(min_per_class)
    return settings


def _condense_settings(
    parent, method, check_k, edit_k, reduction, refine, refine_epochs, seed, min_per_class=None
):
    """The operation's settings, checked; they are recorded in the lineage."""
    if method == "hart":
        prototype_options = (reduction, refine_epochs, refine, min_per_class)
        if any(option is not None for option in prototype_options):
            raise ReferenceError(
                "--reduction, --refine, --refine-epochs and --min-per-class apply to --method "
                "prototypes only"
            )
        check_k = parent.default_k + 2 if check_k is None else int(check_k)
        if check_k < 1 or edit_k < 0:
            raise ReferenceError(
                f"--check-k must be >= 1 and --edit-k >= 0, got {check_k}, {edit_k}"
            )
        return {"check_k": check_k, "edit_k": int(edit_k), "seed": int(seed)}
    if method == "prototypes":
        if check_k is not None or edit_k:
            raise ReferenceError("--check-k and --edit-k apply to --method hart only")
        floor = 1 if min_per_class is None else min_per_class
        return _prototype_settings(
            parent, reduction, refine or "nca", refine_epochs, seed, min_per_class=floor
        )
    raise ReferenceError(f"--method must be one of hart, prototypes; got {method!r}")


def _learned(parent, z, y, settings, checkpoint_dir) -> tuple:
    """Prototypes learned with NCA's objective, the map fixed: (prototypes, labels, ids,
    counts, served k, reference_set record); the learning checkpointed in
    ``checkpoint_dir`` (None: not)."""
    result = compress(
        z,
        y,
        reduction=settings["reduction"],
        n_classes=len(parent.classes),
        rule=parent.decision_rule,
        edit_k=edit_k_for(parent.default_k),
        x_val=parent.validation_embeddings,
        y_val=parent.validation_labels,
        max_iter=settings["refine_epochs"],
        seed=settings["seed"],
        classes=parent.classes,
        min_per_class=settings.get("min_per_class", 1),
        checkpoint_dir=checkpoint_dir,
    )
    fit = result.fit
    rows = representatives(z, y, fit.prototypes, fit.labels)
    record = reference_set_record(
        method="nca, map fixed",
        reduction=settings["reduction"],
        compressed=result,
    )
    counts = {"prototypes": len(fit.labels), "budget": result.budget}
    return fit.prototypes, fit.labels, parent.ids[rows], counts, result.k, record


def _condensed(parent, z, y, settings, unchanged, checkpoint_dir) -> tuple:
    """(embeddings, labels, ids, counts, served k or None, reference_set or None) of the
    condensed set; the parent's when unchanged."""
    if unchanged:
        counts = {"removed_by_editing": 0, "removed_by_condensing": 0}
        return z, y, parent.ids, counts, None, parent.manifest.get("reference_set")
    if settings.get("method") == "prototypes" and settings["refine"] == "nca":
        return _learned(parent, z, y, settings, checkpoint_dir)
    if settings.get("method") == "prototypes":  # --refine none: the cluster means
        centres, labels, representative, _ = prototypes(
            z,
            y,
            reduction=settings["reduction"],
            seed=settings["seed"],
            floor=settings.get("min_per_class", 1),
        )
        budget = budget_record(
            y, settings["reduction"], parent.classes, floor=settings.get("min_per_class", 1)
        )
        record = {
            "kind": "prototypes",
            "method": f"k-means, {settings['refine']} refinement",
            "reduction": settings["reduction"],
            "budget": budget,
            "n_prototypes": len(labels),
            "n_training_rows": len(z),
        }
        return (
            centres,
            labels,
            parent.ids[representative],
            {"prototypes": len(labels), "budget": budget},
            None,
            record,
        )
    keep, counts = condense(z, y, len(parent.classes), **settings)
    return z[keep], y[keep], parent.ids[keep], counts, None, None


def _before_and_after(parent, before, after, ks, X_test, y_test) -> dict:
    """{split: {"before": {k: accuracy}, "after": ...}} on the validation and test rows."""
    n_classes, rule = len(parent.classes), parent.decision_rule

    def accuracies(references, zq, yq) -> dict:  # {k as text: accuracy}
        by_k = knn_accuracies(*references, zq, yq, n_classes, ks, rule)
        return {str(k): v for k, v in by_k.items()}

    return {
        name: {"before": accuracies(before, zq, yq), "after": accuracies(after, zq, yq)}
        for name, (zq, yq) in _evaluation_sets(parent, X_test, y_test).items()
    }


def _evaluation_sets(parent: Artifact, X_test, y_test) -> dict:
    """{name: (embeddings, class indices)}: the artifact's validation split and, when given,
    the test rows projected with the model's map (labels the model must know)."""
    evaluations = {}
    if parent.validation_embeddings is not None and len(parent.validation_embeddings):
        evaluations["validation"] = (parent.validation_embeddings, parent.validation_labels)
    if X_test is not None:
        X_test, y_test = _checked_rows(parent, X_test, y_test)
        unknown = [v for v in dict.fromkeys(y_test.tolist()) if v not in parent.classes]
        if unknown:
            raise ReferenceError(f"--data has labels the model does not know: {unknown[:10]}")
        index_of = {c: i for i, c in enumerate(parent.classes)}
        evaluations["test"] = (
            project(X_test, parent.projection, parent.offset),
            np.array([index_of[v] for v in y_test.tolist()]),
        )
    return evaluations


def condense_references(
    model: str | Path,
    *,
    out: str | Path,
    method: str = "hart",
    check_k: int | None = None,
    edit_k: int = 0,
    reduction: float | None = None,
    refine: str | None = None,
    refine_epochs: int | None = None,
    seed: int = 0,
    X_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    min_per_class: int | None = None,
    checkpoint_dir: str | Path | None = None,
) -> dict:
    """Keep the references the k-NN decision needs (``training.references.condense``); write
    ``out``.

    check_k defaults to the model's default k + 2. Accuracy before and after is measured on
    the artifact's validation split and, when given, on X_test / y_test (raw inputs,
    projected with the model's map), at k = 1, the default k and check_k, with the model's
    rule. Condensing a set this operation produced, with the same settings and nothing
    changed since, returns it unchanged (the operation is idempotent): a second pass would
    judge the kept references without the removed ones that they vouch for.

    method "prototypes": see the module's docstring; ``min_per_class`` (default 1) is the
    budget's floor per class (``training.references.condense.class_budget``). The learning
    is checkpointed in ``checkpoint_dir`` (None: not): a condense killed mid-way and run
    again resumes there, and its files are removed once the new version is written."""
    parent = read_parent(model)
    settings = _condense_settings(
        parent, method, check_k, edit_k, reduction, refine, refine_epochs, seed, min_per_class
    )
    classes = parent.classes
    z, y = np.asarray(parent.embeddings), np.asarray(parent.labels, dtype=np.int64)
    last = (parent.manifest.get("lineage") or [{}])[-1]
    unchanged = last.get("operation") == "condense" and last.get("settings") == settings
    if method == "prototypes" and _is_prototypes(parent) and not unchanged:
        raise ReferenceError(
            "the model's references are already prototypes: learn prototypes from the version "
            f"with the training rows instead (parent {last.get('parent_version')})"
        )
    new_z, new_y, new_ids, counts, k, record = _condensed(
        parent, z, y, settings, unchanged, checkpoint_dir
    )
    check_k = settings.get("check_k", parent.default_k)
    ks = tuple(sorted({1, parent.default_k, check_k} | ({k} if k else set())))
    accuracy = _before_and_after(parent, (z, y), (new_z, new_y), ks, X_test, y_test)
    n_after = len(new_y)
    name = f"prototypes-{settings['refine']}" if method == "prototypes" else method
    entry = {
        "operation": "condense",
        "method": CONDENSE_METHODS["wilson+hart" if method == "hart" and edit_k else name],
        "settings": settings,
        "rows_before": len(z),
        "rows_after": n_after,
        **counts,
        "accuracy": accuracy,
    }
    if k is not None and k != parent.default_k:  # the k the prototypes serve best
        entry["default_k_chosen_on_validation"] = [parent.default_k, k]
    default_k = _default_k_for(parent, n_after, entry, k)
    try:
        path = write_version(
            parent,
            out,
            embeddings=new_z,
            labels=new_y,
            ids=new_ids,
            classes=classes,
            entry=entry,
            default_k=default_k,
            reference_set=record,
        )
    except Interrupted as exc:  # a signal during the write: the version may be in place
        if exc.written and checkpoint_dir is not None:  # it is: the learning is done with
            remove_checkpoints(checkpoint_dir, LOSSES)
        raise
    if checkpoint_dir is not None:
        remove_checkpoints(checkpoint_dir, LOSSES)
    return {**entry, "artifact": str(path)}
