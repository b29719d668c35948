"""What a fit starts from, prepared from the data the process holds: the parameters checked
against the data, the seed, the validation split, the standardisation, the initial map and
the validation score. One process holds all rows (``prepare_local``); a data-parallel rank
holds its shard and summaries of the others' (``prepare_shards``, through
``training.distributed.sharded_stats``); both return the same ``Prepared``, so the rest of the
fit does not know which. Tested by ``tests/training/test_estimator.py`` and
``test_distributed.py`` (sharded fits equal the single-process one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import validate_data

from training.data.datasets import STANDARDIZERS, choose_standardizer, stratified_split
from training.distributed import sharded_stats
from training.distributed.ranks import shard_bounds
from training.evaluation.evaluate import knn_accuracies
from training.model.initialization import initial_components, resolve_auto
from training.references.learned import check_budget

# standardize= values: booleans keep their meaning from before "global" and "auto" existed
STANDARDIZE_MODES = {True: "feature", False: "none"}
INIT_MESSAGES = {
    "pca": "Finding principal components",
    "lda": "Finding most discriminative components",
}


def prepare(est, X, y, X_val, y_val, group) -> Prepared:
    """The fit's starting point from this process's rows (all of them, or its shard)."""
    if group.is_distributed:
        if est.prototypes is not None:
            raise ValueError(
                f"prototypes={est.prototypes!r} learns the prototypes from every training row in "
                "one process; a data-parallel fit holds a shard per rank: use prototypes=None"
            )
        return prepare_shards(est, X, y, X_val, y_val, group)
    return prepare_local(est, X, y, X_val, y_val)


@dataclass
class Prepared:
    """What the optimisation starts from: the standardised rows this process holds (N, D) or
    its shard (N_r, D), every training label (N,), and the rest of the set-up."""

    X: np.ndarray
    y: np.ndarray
    d: int
    rng: np.random.Generator
    device: torch.device
    mean: np.ndarray
    scale: np.ndarray
    theta0: np.ndarray
    init_used: str
    classes: np.ndarray
    validate: Callable  # problem -> (theta -> validation accuracy) or None
    X_val: np.ndarray | None = None  # (V, D) standardised validation rows (one process)
    y_val: np.ndarray | None = None  # (V,) their class indices


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a valid torch device ({exc})") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available here")
    return resolved


def prepare_local(est, X, y, X_val, y_val) -> Prepared:
    """One process: validate, seed, split, standardise and initialise from all rows."""
    X, y = validate_data(est, X, y, ensure_min_samples=2, dtype=np.float64)
    check_classification_targets(y)
    classes, y_idx = np.unique(y, return_inverse=True)
    d = est._validate_params_against(X.shape[0], X.shape[1], len(classes))
    rng = seeded_rng(est)
    device = resolve_device(est.device)
    X_tr, y_tr, X_val, y_val_idx = split_validation(est, X, y_idx, classes, X_val, y_val, rng)
    if est.prototypes is not None:  # the budget is checked before the fit, not after it
        check_budget(y_tr, len(classes), est.prototypes, classes.tolist(), name="prototypes")
    mean, scale = standardizer(est, X_tr, y_tr, len(classes))
    Xs = (X_tr - mean) / scale  # (n, D) standardised training inputs
    theta0, init_used = initialize(est, Xs, y_tr, d, scale, rng)

    def validate(problem):
        return validation_score(est, problem, Xs, y_tr, X_val, y_val_idx, mean, scale, len(classes))

    Xv_s = None if X_val is None else (X_val - mean) / scale
    return Prepared(
        Xs, y_tr, d, rng, device, mean, scale, theta0, init_used, classes, validate, Xv_s, y_val_idx
    )


def prepare_shards(est, X, y, X_val, y_val, group) -> Prepared:
    """Data-parallel: the same steps from this rank's rows and summaries of the others'
    (``training.distributed.sharded_stats``). Returns the standardised shard and all N labels."""
    X, y = validate_data(est, X, y, ensure_min_samples=1, dtype=np.float64)
    check_classification_targets(y)
    classes = sharded_stats.union_classes(y, group)
    y_idx = np.searchsorted(classes, y)
    n = sharded_stats.total_rows(len(X), group)
    start, stop = shard_bounds(n, group.rank, group.world_size)
    if stop - start != len(X):
        raise ValueError(
            f"rank {group.rank} of {group.world_size}: X has {len(X)} rows, but a "
            f"data-parallel fit takes rows [{start}, {stop}) of the N = {n} training rows "
            "(training.distributed.ranks.shard_bounds)"
        )
    d = est._validate_params_against(n, X.shape[1], len(classes))
    rng = seeded_rng(est)
    device = resolve_device(est.device)
    y_all = sharded_stats.gather_labels(y_idx, n, group)  # (N,)
    if X_val is None and est.early_stopping:
        raise ValueError(
            "early_stopping=True in a data-parallel fit needs an explicit validation set: "
            "pass each rank's rows of it as X_val, y_val"
        )
    X_val, y_val_idx, n_val = validation_shard(est, X_val, y_val, classes, X.shape[1], group)

    mean, scale = sharded_standardizer(est, X, y_all, start, n, len(classes), group)
    Xs = (X - mean) / scale  # (N_r, D)
    theta0, init_used = initialize_shards(est, Xs, y_idx, n, len(classes), d, scale, rng, group)
    Xv_s = (X_val - mean) / scale
    ks = est._validation_ks(n)

    def validate(problem):
        if n_val == 0:
            return None

        def score(theta):
            A = problem.components(theta)  # (d, D)
            z_tr = sharded_stats.gather_array((Xs @ A.T).astype(np.float32), n, group)
            z_va = (Xv_s @ A.T).astype(np.float32)
            accuracies = sharded_stats.knn_accuracy(
                z_tr,
                y_all,
                z_va,
                y_val_idx,
                len(classes),
                ks,
                est.validation_rule,
                n_val,
                group,
            )
            return max(accuracies.values())

        return score

    return Prepared(Xs, y_all, d, rng, device, mean, scale, theta0, init_used, classes, validate)


def sharded_standardizer(est, X, y_all, start: int, n: int, n_classes: int, group):
    """``standardizer`` for shards: mean (D,) and scale (D,) from all ranks' statistics;
    sets standardization_ and standardization_scores_."""
    est.standardization_scores_ = None
    name = STANDARDIZE_MODES.get(est.standardize, est.standardize)
    if name == "auto":
        name, est.standardization_scores_ = sharded_stats.choose_standardizer(
            X, y_all, start, n_classes, group
        )
    est.standardization_ = name
    if name == "none":
        mean, scale = np.zeros(X.shape[1]), np.ones(X.shape[1])
    else:
        mean, scale = sharded_stats.standardizer(name, X, n, group)
    return mean, scale


def validation_shard(est, X_val, y_val, classes, n_features, group):
    """This rank's validation rows (possibly none), their class indices, and the number
    of validation rows over all ranks (0: no validation)."""
    if X_val is None or len(X_val) == 0:
        X_val, y_val_idx = np.empty((0, n_features)), np.empty(0, dtype=np.int64)
    else:
        X_val = validate_data(est, X_val, reset=False, dtype=np.float64)
        y_val = np.asarray(y_val)
        unknown = np.setdiff1d(np.unique(y_val), classes)
        if unknown.size:
            raise ValueError(f"y_val has labels not present in y: {unknown.tolist()}")
        y_val_idx = np.searchsorted(classes, y_val)
    return X_val, y_val_idx, sharded_stats.total_rows(len(X_val), group)


def initialize_shards(est, Xs, y_idx, n, n_classes, d, scale, rng, group):
    """``_initialize`` for shards: PCA and LDA from reduced scatter matrices; the rules
    that need no data (identity, random, an array, an artifact, warm start) as usual."""
    init = est.init
    if est.warm_start and hasattr(est, "components_"):
        init = est.components_
    name = str(init) if isinstance(init, str) else None
    if name == "auto":
        name = resolve_auto(d, Xs.shape[1], n, n_classes)
    if name == "pca":
        A0 = sharded_stats.pca_components(Xs, n, d, group)
    elif name == "lda":
        if d > min(Xs.shape[1], n_classes - 1) or n <= n_classes:
            raise ValueError(
                f"init='lda' gives at most min(n_features, n_classes - 1) = "
                f"{min(Xs.shape[1], n_classes - 1)} components and needs more samples "
                f"than classes; got n_components={d}, {n} samples, {n_classes} classes"
            )
        A0 = sharded_stats.lda_components(Xs, y_idx, n, n_classes, d, group)
    else:
        A0, name = initial_components(
            init if name is None else name, Xs, y_idx, d, random_state=rng, scale=scale
        )
    theta0 = np.diag(A0).copy() if est.transformation == "diagonal" else A0
    return theta0, name


def standardizer(est, X_tr, y_tr, n_classes) -> tuple[np.ndarray, np.ndarray]:
    """mean (D,) and scale (D,) of the chosen standardisation; sets standardization_ and
    standardization_scores_ (the kNN scores "auto" chose by, else None)."""
    est.standardization_scores_ = None
    name = STANDARDIZE_MODES.get(est.standardize, est.standardize)
    if name == "auto":
        name, est.standardization_scores_ = choose_standardizer(X_tr, y_tr, n_classes)
    est.standardization_ = name
    if name == "none":
        return np.zeros(X_tr.shape[1]), np.ones(X_tr.shape[1])
    return STANDARDIZERS[name](X_tr)


def seeded_rng(est) -> np.random.Generator:
    """numpy's generator from random_state; torch seeded from it (candidate ties, SGD)."""
    seed = est.random_state
    if isinstance(seed, np.random.RandomState):
        seed = seed.randint(2**31 - 1)
    try:
        rng = np.random.default_rng(seed)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"random_state={est.random_state!r} must be None, an integer >= 0, a numpy "
            f"Generator or RandomState ({error})"
        ) from None
    torch.manual_seed(int(rng.integers(2**31 - 1)))
    return rng


def split_validation(est, X, y_idx, classes, X_val, y_val, rng):
    """(X_train, y_train, X_val or None, y_val class indices or None).

    An explicit validation set is used as given (its labels must occur in y); otherwise,
    with early stopping, a stratified ``validation_fraction`` of X is held out.
    """
    if X_val is not None:
        X_val = validate_data(est, X_val, reset=False, dtype=np.float64)
        y_val = np.asarray(y_val)
        unknown = np.setdiff1d(np.unique(y_val), classes)
        if unknown.size:
            raise ValueError(f"y_val has labels not present in y: {unknown.tolist()}")
        return X, y_idx, X_val, np.searchsorted(classes, y_val)
    if est.early_stopping:
        tr, va = stratified_split(y_idx, (est.validation_fraction,), int(rng.integers(2**31)))
        if len(va) == 0:
            return X[tr], y_idx[tr], None, None
        return X[tr], y_idx[tr], X[va], y_idx[va]
    return X, y_idx, None, None


def initialize(est, Xs, y, d, scale, rng):
    """(theta0, the init used): the initial A (d, D) from ``init``, or the previous
    components with ``warm_start``; its diagonal when the transformation is diagonal."""
    init = est.init
    if est.warm_start and hasattr(est, "components_"):
        if est.components_.shape[1] != Xs.shape[1]:
            raise ValueError(
                f"The new inputs dimensionality ({Xs.shape[1]}) does not match the input "
                "dimensionality of the previously learned transformation "
                f"({est.components_.shape[1]})."
            )
        init = est.components_
    started = time.perf_counter()
    A0, init_used = initial_components(init, Xs, y, d, random_state=rng, scale=scale)
    if est.verbose and init_used in INIT_MESSAGES:  # scikit-learn's line, after the fact
        print(f"{INIT_MESSAGES[init_used]}... done in {time.perf_counter() - started:5.2f}s")
    theta0 = np.diag(A0).copy() if est.transformation == "diagonal" else A0
    return theta0, init_used


def validation_score(est, problem, Xs, y_tr, X_val, y_val_idx, mean, scale, n_classes):
    """theta -> validation kNN accuracy with the rule and (best of the) k to be served,
    the training points as references; None without a validation set."""
    if X_val is None or not len(X_val):
        return None
    Xv_s = (X_val - mean) / scale
    ks = est._validation_ks(len(Xs))

    def validate(theta):
        A = problem.components(theta)  # (d, D)
        z_tr = (Xs @ A.T).astype(np.float32)
        z_va = (Xv_s @ A.T).astype(np.float32)
        accuracies = knn_accuracies(z_tr, y_tr, z_va, y_val_idx, n_classes, ks, est.validation_rule)
        return max(accuracies.values())

    return validate
