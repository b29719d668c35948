"""Compress a reference set to learned prototypes: Wilson editing where labels are noisy, the
prototypes learned (``training.references.learned``), the served k chosen, real ids kept.

Label noise puts mislabelled rows inside other classes; per-class k-means then starts
prototypes there, and a prototype carries its label to every query near it, where k-NN on
all rows would outvote a single wrong neighbour. Wilson editing (Barber, ch. 14.1;
``training.references.condense.wilson_keep``) removes the rows whose ``edit_k`` nearest
others (``edit_k``: the full set's served k, at least 3) outvote their label before the
prototypes are placed and learned. It is applied when it would remove at least
``EDIT_MIN_FRACTION`` (5%) of the rows: on clean data it would remove only a few correct rows
on the class boundaries (at a small cost), under label noise far more. The share is a direct
estimate of how noisy or overlapping the labels are; a choice on the validation split was
unreliable where that split is small and noisy. The budget is counted on the rows before
editing (``training.references.condense.class_budget``) either way. Under label noise,
editing brings learned prototypes to about the full set's test accuracy, or above it
(``benchmarks/learned_references.py``; benchmarks/README.md, "Learned reference sets").

Which of NCA's two losses (``learned.LOSSES``) to learn with depends on the data: neither is
closer to the full set on every set (benchmarks/README.md, "Learner settings on the clean
60k map"). ``loss="auto"`` (the default) learns both from the same start and keeps the one
with the better validation accuracy at its served k (f among equals); without a validation
split it learns f. It costs both fits (f is the faster).

Tests: ``tests/training/references/test_learned_references.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from training.references.condense import budget_record, class_budget, wilson_keep
from training.references.learned import LOSSES, PrototypeFit, learn_prototypes, served_k

EDIT_MIN_FRACTION = 0.05  # edit when at least this share of the rows is outvoted


@dataclass
class Compressed:
    """A learned reference set: the fit (prototypes, labels, map in the joint mode), the k it
    serves best on validation, the validation accuracies by k, the editing it used, the loss
    it was learned with and, per loss tried, the validation accuracy at its served k, and the
    budget (``training.references.condense.budget_record``: prototypes per class)."""

    fit: PrototypeFit
    k: int
    validation: dict
    editing: dict
    n_rows: int = 0  # the training rows before editing
    loss: str = "f"
    tried: dict = field(default_factory=dict)  # {loss: validation accuracy at its served k}
    budget: dict = field(default_factory=dict)


def edit_k_for(default_k: int) -> int:
    """The editing neighbourhood: the model's served k (odd, at least 3), the k validation
    found best for the full set; it is larger where labels are noisier."""
    return max(3, default_k | 1)


def compress(
    x: np.ndarray,
    y: np.ndarray,
    *,
    reduction: float,
    n_classes: int,
    rule: str,
    edit_k: int,
    x_val: np.ndarray | None = None,
    y_val: np.ndarray | None = None,
    u: np.ndarray | None = None,
    loss: str = "auto",
    classes=None,
    min_per_class: int = 1,
    **learn,
) -> Compressed:
    """x (N, d) embeddings (map fixed) or (N, D) standardised rows (joint, with
    ``projection`` in ``learn``); u (N, d) the embeddings editing looks at (x itself when
    None). ``learn`` goes to ``learn_prototypes``. The rows are Wilson-edited first when
    editing would remove at least ``EDIT_MIN_FRACTION`` of them. loss: "f", "log", or "auto"
    (both learned, the better on validation kept; f without a validation split). classes:
    the names of y's class indices, for the budget's record. min_per_class: the budget's
    floor per class (``training.references.condense.class_budget``)."""
    if loss != "auto" and loss not in LOSSES:
        raise ValueError(f"loss must be 'auto' or one of {LOSSES}, got {loss!r}")
    u = x if u is None else u
    keep = wilson_keep(u, y, n_classes, edit_k) if edit_k > 0 else np.ones(len(y), dtype=bool)
    for c in np.unique(y[~keep]):  # a class editing would empty keeps its rows
        if not keep[y == c].any():
            keep[y == c] = True
    outvoted = int((~keep).sum())
    edited = outvoted >= EDIT_MIN_FRACTION * len(y)
    rows = keep if edited else np.ones(len(y), dtype=bool)
    budget = class_budget(y, reduction, min_per_class)  # counted on the rows before editing
    has_validation = x_val is not None and len(x_val) > 0
    if loss != "auto":
        losses = (loss,)
    else:
        losses = ("f", "log") if has_validation else ("f",)
    fits = {}  # loss -> (fit, served k, {k: validation accuracy})
    for name in losses:
        fit = learn_prototypes(
            x[rows], y[rows], reduction=budget, x_val=x_val, y_val=y_val, loss=name, **learn
        )
        z_val = x_val
        if has_validation and fit.projection is not None:
            z_val = x_val @ fit.projection.T.astype(x_val.dtype)
        fits[name] = (fit, *served_k(fit.prototypes, fit.labels, z_val, y_val, n_classes, rule))
    tried = {name: float(acc.get(k, np.nan)) for name, (_, k, acc) in fits.items()}
    chosen = max(losses, key=tried.get)  # the first among equals; NaN only when one is tried
    fit, k, accuracy = fits[chosen]
    editing = {"edit_k": int(edit_k), "outvoted_rows": outvoted, "edited": bool(edited)}
    budget_said = budget_record(y, reduction, classes, made=fit.labels, floor=min_per_class)
    return Compressed(
        fit, k, accuracy, editing, n_rows=len(y), loss=chosen, tried=tried, budget=budget_said
    )


def reference_set_record(*, method: str, reduction: float, compressed: Compressed) -> dict:
    """The manifest's ``reference_set``: what the references are and how they were made."""
    fit = compressed.fit
    return {
        "kind": "prototypes",
        "method": method,
        "objective": f"NCA {compressed.loss} loss of the training rows against the prototypes",
        "losses_tried": {
            name: None if np.isnan(acc) else round(acc, 6) for name, acc in compressed.tried.items()
        },
        "reduction": reduction,
        "budget": compressed.budget,
        "n_prototypes": len(fit.labels),
        "n_training_rows": compressed.n_rows,
        "editing": compressed.editing,
        "iterations": int(fit.n_iter),
        "kept_iteration": int(fit.best_iter),
        "seconds": round(float(fit.seconds), 3),
        "ids": "each prototype's id is the training row of its class nearest it; neighbour "
        "distances are to the prototype, not to that row",
    }
