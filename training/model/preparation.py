"""What a fit starts from, prepared from the rows this process holds: the parameters
checked against the data, the seed, the held-out rows, the standardisation, the initial map
and the scores that judge the fit. One code path: a single process is a group of one
(``training.distributed.ranks.ProcessGroup``), whose shard is every row; a data-parallel
rank holds its shard and reduces summaries with the others'
(``training.distributed.sharded_stats``), so every rank prepares what one process would.

Memory: the rows are read a block at a time (a memory-mapped ``.npy`` stays mapped); the
one full copy made is the standardised float32 training rows the objective reads (N, D).
Statistics (moments, PCA and LDA scatter matrices, the choice of standardisation on a
sample) accumulate in float64 over blocks.

Held-out rows: an explicit validation set, or with early stopping a stratified
``validation_fraction``; otherwise, with ``select_stages`` on more than
``HOLDOUT_MIN_SAMPLES`` rows, a stratified sample of ``min(SELECTION_ROWS, N / 10)`` rows is
held out of the fit to judge its stages on (``training.model.fitting``): rows the map was
trained on cannot tell an overfit stage from a better one.

Tested by ``tests/training/model/test_estimator.py`` and ``test_distributed.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import validate_data

from training.data.datasets import check_finite, check_float32_range, stratified_split
from training.distributed import sharded_stats
from training.model import parameters, sparse_input
from training.model.initialization import (
    calibrated,
    check_lda,
    initial_components,
    resolve_auto,
)
from training.model.options import validation_ks
from training.model.plan import AUTO_EXACT_MAX_SAMPLES
from training.numerics import evenly_spaced_rows, shard_bounds
from training.references.learned import check_budget

VALIDATION_MAX_ROWS = 8192  # validation rows a check during the fit classifies
HOLDOUT_MIN_SAMPLES = AUTO_EXACT_MAX_SAMPLES  # below, a fit without validation holds none out
SELECTION_ROWS = 4096  # ... and above, min(SELECTION_ROWS, N / 10) rows held out to judge it
# standardize= values: booleans keep their meaning from before "global" and "auto" existed
STANDARDIZE_MODES = {True: "feature", False: "none"}
BUILT_INITS = ("pca", "lda", "identity", "random")  # the initial maps init_scale applies to
INIT_MESSAGES = {
    "pca": "Finding principal components",
    "lda": "Finding most discriminative components",
}


@dataclass
class Prepared:
    """What the optimisation starts from: the standardised float32 training rows this process
    holds (N, D), or its shard (N_r, D), every training label (N,), and the rest of the
    set-up."""

    X: np.ndarray
    y: np.ndarray
    d: int
    rng: np.random.Generator
    device: torch.device
    mean: np.ndarray
    scale: np.ndarray
    theta0: np.ndarray
    init_used: str
    init_scale: float  # the factor the initial map was scaled by
    standardization: str  # "feature", "global" or "none"
    standardization_scores: dict | None  # the kNN scores "auto" chose by (None: not chosen)
    classes: np.ndarray
    # the held-out rows that judge the fit's maps (None: none held out, on any rank)
    held_out: HeldOutScores | None
    X_val: np.ndarray | None = None  # (V, D) standardised validation rows (this process's)
    y_val: np.ndarray | None = None  # (V,) their class indices


def prepare(est, settings, X, y, X_val, y_val, group) -> Prepared:
    """The fit's starting point from this process's rows: all of them, or its shard.

    est: the estimator (validate_data records n_features_in_ on it; a warm start reads its
    components_); settings: every setting of the fit by name
    (``training.model.options.fit_settings``), checked here against its table of
    constraints (``training.model.parameters``)."""
    parameters.check(vars(settings))
    if group.is_distributed and settings.prototypes is not None:
        raise ValueError(
            f"prototypes={settings.prototypes!r} learns the prototypes from every training row in "
            "one process; a data-parallel fit holds a shard per rank: use prototypes=None"
        )
    X, y = validate_data(
        est,
        X,
        y,
        accept_sparse=sparse_input.SPARSE_FORMATS,  # CSR / CSC kept sparse (sparse_input)
        ensure_min_samples=1 if group.is_distributed else 2,
        dtype=FLOAT_TYPES,
        ensure_all_finite=False,  # checked below, naming the row and column
    )
    if sparse_input.is_sparse(X):
        sparse_input.check_settings(settings, group.is_distributed, n_features=X.shape[1])
        sparse_input.check_float32_range(X, "X")
    else:
        check_finite(X, "X")  # ValueErrors naming the first such value, as the CLI does
        check_float32_range(X, "X")
        check_float32_resolution(X, group)
    check_classification_targets(y)
    classes = sharded_stats.union_classes(y, group)
    y_idx = np.searchsorted(classes, y)
    rng = seeded_rng(settings)
    device = resolve_device(settings.device)
    rows, held, X_val, y_val_idx = held_out(
        est, settings, X, y_idx, classes, X_val, y_val, rng, group
    )
    n = sharded_stats.total_rows(len(rows), group)
    check_shard(len(rows), n, group)
    d = parameters.check_against_data(settings, n, X.shape[1])
    y_all = sharded_stats.gather_labels(y_idx[rows], n, group)  # (N,)
    if settings.prototypes is not None:  # the budget is checked before the fit, not after it
        check_budget(y_all, len(classes), settings.prototypes, classes.tolist(), name="prototypes")
    start = shard_bounds(n, group.rank, group.world_size)[0]
    standardization, choice_scores, mean, scale = standardizer(
        settings, X, rows, y_all, start, n, len(classes), group
    )
    Xs = standardized(X, mean, scale, rows)  # (N_r, D) float32, dense or CSR
    if sharded_stats.varying_features(Xs, group) == 0:  # before any objective is evaluated
        if sharded_stats.varying_features(X, group, rows) > 0:  # lost to float32 on the way
            raise ValueError(
                f"X: its features differ over the {n} training rows only below what float32, "
                "which the fit, the map and the service compute in, can hold (values under "
                "about 1e-38, or differences below its resolution): rescale the data"
            )
        raise ValueError(
            f"X: every one of its {X.shape[1]} features has the same value in all {n} "
            "training rows, so every distance between two rows is 0 and no map can tell the "
            "classes apart; expected at least one feature that varies"
        )
    theta0, init_used = initialize(
        est, settings, Xs, y_idx[rows], n, len(classes), d, scale, rng, group
    )
    theta0, init_scale = scaled_init(settings, theta0, init_used, Xs, y_all, n, group)
    Xv_s, yv = None, None
    if X_val is not None:  # a validation split: its rows standardised here (one full pass)
        Xv_s, yv = standardized(X_val, mean, scale), y_val_idx
    elif held is not None:  # rows held out of this fit to judge it
        Xv_s, yv = standardized(X, mean, scale, held), y_idx[held]
    scores = HeldOutScores(
        settings, Xs, y_all, Xv_s, yv, len(classes), n, group, validation=X_val is not None
    )  # built on every rank: it counts every rank's held-out rows
    return Prepared(
        X=Xs,
        y=y_all,
        d=d,
        rng=rng,
        device=device,
        mean=mean,
        scale=scale,
        theta0=theta0,
        init_used=init_used,
        init_scale=init_scale,
        standardization=standardization,
        standardization_scores=choice_scores,
        classes=classes,
        held_out=scores if scores.n_rows else None,
        X_val=Xv_s if X_val is not None else None,
        y_val=yv if X_val is not None else None,
    )


# float32's spacing at a column's size above this fraction of its standard deviation: the
# service, which projects the raw inputs in float32, would lose the column's differences
FLOAT32_SPACING_RATIO = 0.01


def check_float32_resolution(X: np.ndarray, group) -> None:
    """ValueError naming the first column of X (all ranks' rows) whose values differ by less
    than float32 resolves at their size: spacing32(sqrt(mean^2 + var)) above
    FLOAT32_SPACING_RATIO * sqrt(var). The fit standardises in float64 and would learn from
    such a column; the artifact projects a query's raw values in float32
    (z = x @ projection.T + offset), where they are one value, or noise, and the served map
    would answer at chance (timestamps near 1.7e9 that differ by seconds, say)."""
    if X.dtype == np.float32 or len(X) == 0:
        return  # float32 values are what the service reads: nothing is lost on the way
    n = sharded_stats.total_rows(len(X), group)
    mean, var = sharded_stats.moments(X, n, group)  # (D,), (D,) in float64
    std = np.sqrt(var)
    spacing = np.spacing(np.sqrt(mean**2 + var).astype(np.float32)).astype(np.float64)
    lost = (std > 0) & (spacing > FLOAT32_SPACING_RATIO * std)
    if lost.any():
        c = int(np.flatnonzero(lost)[0])
        raise ValueError(
            f"X: column {c} has values around {mean[c]:.6g} that differ by {std[c]:.3g} "
            f"(standard deviation), but float32, which the map and the service compute in, "
            f"resolves only {spacing[c]:.3g} at that size, so the served map would not see "
            "the column's differences; subtract its mean (or a value near it) from the "
            "column, or rescale it, before training"
        )


FLOAT_TYPES = [np.float64, np.float32]  # float32 inputs stay float32: no float64 copy


def standardized(X, mean: np.ndarray, scale: np.ndarray, rows: np.ndarray | None = None):
    """(X[rows] - mean) / scale as float32 (n, D); a sparse X (which is never centred:
    mean 0, scale 1) as CSR float32."""
    if sparse_input.is_sparse(X):
        return sparse_input.rows_float32(X, rows)
    return sharded_stats.standardized(X, mean, scale, rows)


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


def seeded_rng(settings) -> np.random.Generator:
    """numpy's generator from random_state; torch seeded from it (candidate ties, SGD)."""
    seed = settings.random_state
    if isinstance(seed, np.random.RandomState):
        seed = seed.randint(2**31 - 1)
    try:
        rng = np.random.default_rng(seed)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"random_state={settings.random_state!r} must be None, an integer >= 0, a numpy "
            f"Generator or RandomState ({error})"
        ) from None
    torch.manual_seed(int(rng.integers(2**31 - 1)))
    return rng


def check_shard(n_local: int, n: int, group) -> None:
    """A data-parallel rank must hold exactly its rows of the N training rows."""
    start, stop = shard_bounds(n, group.rank, group.world_size)
    if stop - start != n_local:
        raise ValueError(
            f"rank {group.rank} of {group.world_size}: X has {n_local} rows, but a "
            f"data-parallel fit takes rows [{start}, {stop}) of the N = {n} training rows "
            "(training.numerics.shard_bounds)"
        )


def held_out(est, settings, X, y_idx, classes, X_val, y_val, rng, group):
    """(training rows of X, rows of X held out to judge the fit or None, the validation set
    or None, its class indices or None).

    An explicit validation set is used as given (its labels must occur in y). Otherwise, in
    one process: with early stopping a stratified ``validation_fraction`` of X becomes the
    validation set; with ``select_stages`` and more than HOLDOUT_MIN_SAMPLES rows, a
    stratified min(SELECTION_ROWS, N / 10) rows are held out to judge the stages (none when
    the user's ``held_out_score`` judges them). A data-parallel fit holds nothing out (each
    rank's shard is fixed)."""
    every = np.arange(X.shape[0])
    if X_val is not None and X_val.shape[0]:
        X_val = validate_data(
            est,
            X_val,
            reset=False,
            accept_sparse=sparse_input.SPARSE_FORMATS,
            dtype=FLOAT_TYPES,
            ensure_all_finite=False,  # checked below, naming the row and column
        )
        if sparse_input.is_sparse(X_val) and not sparse_input.is_sparse(X):
            # a dense X is standardised, and its validation rows must be too: their dense
            # copy (X itself is dense, so this is no larger than what the fit holds)
            X_val = X_val.toarray()
        if sparse_input.is_sparse(X_val):
            sparse_input.check_float32_range(X_val, "X_val")
        else:
            check_finite(X_val, "X_val")
            check_float32_range(X_val, "X_val")
        y_val = np.asarray(y_val)
        unknown = np.setdiff1d(np.unique(y_val), classes)
        if unknown.size:
            raise ValueError(f"y_val has labels not present in y: {unknown.tolist()}")
        return every, None, X_val, np.searchsorted(classes, y_val)
    if group.is_distributed:
        if settings.early_stopping:
            raise ValueError(
                "early_stopping=True in a data-parallel fit needs an explicit validation set: "
                "pass each rank's rows of it as X_val, y_val"
            )
        return every, None, None, None
    if settings.early_stopping:
        tr, va = stratified_split(y_idx, (settings.validation_fraction,), int(rng.integers(2**31)))
        if len(va) == 0:
            return tr, None, None, None
        return tr, None, X[va] if sparse_input.is_sparse(X) else np.asarray(X[va]), y_idx[va]
    judged_by_rows = settings.held_out_score is None
    if settings.select_stages and judged_by_rows and X.shape[0] > HOLDOUT_MIN_SAMPLES:
        fraction = min(SELECTION_ROWS, X.shape[0] // 10) / X.shape[0]
        tr, held = stratified_split(y_idx, (fraction,), int(rng.integers(2**31)))
        return tr, held, None, None
    return every, None, None, None


def standardizer(settings, X, rows, y_all, start, n, n_classes, group):
    """(name, the kNN scores "auto" chose by or None, mean (D,), scale (D,)) of the chosen
    standardisation of the training rows."""
    unit = np.zeros(X.shape[1]), np.ones(X.shape[1])
    if sparse_input.is_sparse(X):  # never centred: the zeros stay zeros (sparse_input)
        return "none", None, *unit
    name, scores = STANDARDIZE_MODES.get(settings.standardize, settings.standardize), None
    if name == "auto":
        name, scores = sharded_stats.choose_standardizer(
            X, y_all, start, n_classes, group, rows=rows
        )
    if name == "none":
        return name, scores, *unit
    return name, scores, *sharded_stats.standardizer(name, X, n, group, rows)


def initialize(est, settings, Xs, y_idx, n, n_classes, d, scale, rng, group):
    """(theta0, the init used): the initial A (d, D) from ``init``, or the previous
    components with ``warm_start``; its diagonal when the transformation is diagonal. PCA
    and LDA from D x D scatter matrices reduced over blocks (and ranks); the other rules
    need no statistics."""
    init = settings.init
    if settings.warm_start and hasattr(est, "components_"):
        if est.components_.shape[1] != Xs.shape[1]:
            raise ValueError(
                f"The new inputs dimensionality ({Xs.shape[1]}) does not match the input "
                "dimensionality of the previously learned transformation "
                f"({est.components_.shape[1]})."
            )
        init = est.components_
    name = str(init) if isinstance(init, str) else None
    if name == "auto":
        name = resolve_auto(d, Xs.shape[1], n, n_classes)
    started = time.perf_counter()
    if sparse_input.is_sparse(Xs) and name in ("pca", "lda"):  # lda is refused before
        A0, name = sparse_input.initial_components(Xs, d, int(rng.integers(2**31 - 1)))
    elif name == "pca":
        A0 = sharded_stats.pca_components(Xs, n, d, group)
    elif name == "lda":
        check_lda(d, n, Xs.shape[1], n_classes)
        A0 = sharded_stats.lda_components(Xs, y_idx, n, n_classes, d, group)
    else:
        A0, name = initial_components(
            init if name is None else name, Xs, d, random_state=rng, scale=scale
        )
    if settings.verbose and name in INIT_MESSAGES and group.rank == 0:  # scikit-learn's line
        print(f"{INIT_MESSAGES[name]}... done in {time.perf_counter() - started:5.2f}s")
    theta0 = np.diag(A0).copy() if settings.transformation == "diagonal" else A0
    return theta0, name


def scaled_init(settings, theta0, init_used: str, Xs, y_all, n: int, group) -> tuple:
    """(the initial map, the factor it was scaled by) at the scale ``init_scale`` asks for:
    "auto" the factor that maximises NCA's log-likelihood along its direction
    (``training.model.initialization``), a number that factor; maps the estimator built
    (pca, lda, identity, random) only, a given matrix, artifact or warm start is used as
    given (factor 1)."""
    if init_used not in BUILT_INITS:
        return theta0, 1.0
    if settings.init_scale != "auto":
        return theta0 * float(settings.init_scale), float(settings.init_scale)
    if settings.transformation == "diagonal":
        z_local = Xs * theta0[None, :].astype(np.float32)  # (N_r, D)
    else:
        z_local = Xs @ theta0.T.astype(np.float32)  # (N_r, d)
    z = sharded_stats.gather_array(np.ascontiguousarray(z_local, dtype=np.float32), n, group)
    return calibrated(theta0, z, y_all)  # the same on every rank


class HeldOutScores:
    """A map's (score, accuracy) on held-out rows against every training row's embedding.
    The score, which judges the fit's stages, is their soft-neighbour score
    (``sharded_stats.soft_neighbour_score``: NCA's p_i at its best temperature, blind to the
    map's scale), which moves with a gain that their accuracy is too coarse to show. The
    accuracy, for a validation split only (None for rows held out of the fit), is their
    k-NN accuracy with the rule and (best of the) k to be served: what ``val_accuracy``
    and ``best_val_accuracy_`` report. One neighbour search serves both. At most
    VALIDATION_MAX_ROWS evenly spaced held-out rows, so a check costs O(N d) whatever their
    number. Each rank scores its own held-out rows and the sums are reduced."""

    def __init__(self, settings, Xs, y_all, X_held, y_held, n_classes, n, group, validation):
        self.Xs, self.y_all, self.n_classes, self.n, self.group = Xs, y_all, n_classes, n, group
        self.validation = validation  # the held-out rows are a validation split
        self.ks = validation_ks(settings, n)
        self.rule = settings.validation_rule
        self.X_held = self.y_held = None
        if X_held is not None:
            keep = evenly_spaced_rows(X_held.shape[0], VALIDATION_MAX_ROWS)
            self.X_held, self.y_held = X_held[keep], y_held[keep]
        held_rows = 0 if X_held is None else self.X_held.shape[0]
        self.n_rows = sharded_stats.total_rows(held_rows, group)

    def figures(self, A: np.ndarray) -> tuple[float, float | None]:
        """(score, accuracy or None) of the map A (d, D) float32 (a collective under
        torchrun: every rank calls it with the same map)."""
        z_tr = sharded_stats.gather_array(self.Xs @ A.T, self.n, self.group)  # (N, d)
        z_held = self.X_held @ A.T  # (Q_r, d)
        m = sharded_stats.SOFT_NEIGHBOURS
        if self.validation:  # the same search gives the served k's votes
            m = max(m, *self.ks)
        neighbours = sharded_stats.held_out_neighbours(z_tr, z_held, m)
        score = sharded_stats.soft_neighbour_score(
            z_tr, self.y_all, z_held, self.y_held, self.n_rows, self.group, neighbours
        )
        if not self.validation:
            return score, None
        accuracies = sharded_stats.knn_accuracy(
            neighbours,
            self.y_all,
            self.y_held,
            self.n_classes,
            self.ks,
            self.rule,
            self.n_rows,
            self.group,
        )
        return score, max(accuracies.values())
