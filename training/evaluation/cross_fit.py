"""The served k and vote chosen on out-of-fold votes, when the validation split is small.

A validation split of n rows moves its curve over k by 1/n a row, and the curves of
neighbouring ks differ by less than a point, so a small split can choose a k that serves
unseen rows worse (benchmarks/README.md, "The served k cross-fitted on small sets").

Cross-fitting votes with every row the job may learn from, each from a map that never saw it:

1. pool the training and the validation rows (M of them) and deal each class's rows, in
   a seeded random order, into F folds in turn (every fold holds about M / F rows of each
   class: ``fold_of``);
2. for each fold f, fit a map with the job's settings on the other F - 1 folds and project
   all M rows with it;
3. let each row of fold f vote among the rows of the other folds, for every k and rule:
   right votes c_f(rule, k);
4. the curve is acc(rule, k) = sum_f c_f(rule, k) / M, on M rows instead of n.

The job serves the map fitted on the training split, with its references; only the
(rule, k) come from this curve, chosen as on the validation split
(``training.evaluation.evaluate.choose_rule_and_k``). It costs F more fits on
(F - 1) / F of the rows, so ``auto`` cross-fits only where a fit takes seconds: a
validation split under CROSS_FIT_BELOW_VALIDATION rows and at most CROSS_FIT_MAX_ROWS
pooled rows. A data-parallel run and learned prototypes (the served references are the
fit's own prototypes) choose on the validation split.

The job calls ``check_k_folds`` on --k-folds before it reads the data (and again, with the
largest class's rows, before the fit) and ``choose_served_k`` once the map is fitted.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

from training.errors import ConfigError, Interrupted, holding_interrupts
from training.evaluation.evaluate import K_VALUES, choose_rule_and_k, knn_accuracies_by_rule

CROSS_FIT_FOLDS = 5
CROSS_FIT_BELOW_VALIDATION = 1000  # validation rows: below this, auto cross-fits
CROSS_FIT_MAX_ROWS = 20_000  # pooled rows: above this a fit takes minutes, and auto does not


def check_k_folds(
    value: str,
    *,
    distributed: bool = False,
    prototypes: float | None = None,
    largest: int | None = None,
) -> int | str:
    """--k-folds as "auto" or a number of folds (0, or 2 and more, in ASCII digits), checked
    before the data is read and, given the training and validation rows of the largest class
    (``largest``: each class's rows are dealt to the folds in turn, so no more folds can hold
    rows), before the fit: ConfigError naming the value and what it accepts, or a cross-fit
    the run cannot make (a data-parallel run; learned prototypes, the fit's own references)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if not re.fullmatch(r"[0-9]+", text) or int(text) == 1:
        raise ConfigError(
            f"--k-folds={value!r} must be auto, 0 (choose k on the validation split) "
            "or a number of folds >= 2"
        )
    folds = int(text)
    if folds and distributed:
        raise ConfigError(
            f"--k-folds={value!r}: a data-parallel run chooses k on its validation split "
            "(each rank holds a shard); use --k-folds 0 or auto"
        )
    if folds and prototypes is not None:
        raise ConfigError(
            f"--k-folds={value!r} with --prototypes: the served references are the fit's own "
            "prototypes, which a fold's fit would not share; use --k-folds 0 or auto"
        )
    if largest is not None and folds > largest:
        raise ConfigError(
            f"--k-folds={value!r}: the largest class has {largest} training and validation "
            f"rows, dealt to the folds in turn, so at most {largest} folds can hold rows; "
            f"expected at most {largest}"
        )
    return folds


def largest_class(split) -> int:
    """The training and validation rows of the split's largest class."""
    return int(np.bincount(np.concatenate([split.y_train, split.y_val])).max())


def choose_served_k(
    make_estimator: Callable,
    split,
    setting: str,
    seed: int,
    rules: tuple[str, ...],
    val_by_rule: dict[str, dict[int, float]],
    fallback: int,
    log: Callable[[str], None],
) -> tuple[str, int, dict]:
    """(rule, k, k_choice): the served vote and k, chosen on the validation split's curve
    (val_by_rule) or, when ``setting`` (--k-folds) asks for folds (``folds_for``), on the
    cross-fitted curve over the split's training and validation rows, with maps from
    ``make_estimator()``; ``fallback``: the training k, where no curve has a best. k_choice
    records which curve chose, on how many rows (the cross-fitted curve beside them); a fold
    whose rows the fit refuses leaves the choice to the validation split, said in
    ``cross_fit_failed`` and by ``log``."""
    pooled = split.n_train + split.n_val
    folds = folds_for(check_k_folds(setting), split.n_val, pooled)
    validation = {"method": "validation", "rows": split.n_val}
    if not folds:
        return (*choose_rule_and_k(val_by_rule, fallback), validation)
    log(f"choosing k: {folds} maps cross-fitted on {pooled} training and validation rows")
    stack = sp.vstack if sp.issparse(split.X_train) else np.vstack
    try:
        curve = cross_fitted_accuracies(
            make_estimator,
            stack([split.X_train, split.X_val]),
            np.concatenate([split.y_train, split.y_val]),
            len(split.classes),
            tuple(k for k in K_VALUES if k <= split.n_train),  # the references served: every k
            rules,
            folds,
            seed,
        )
    except ValueError as exc:  # a fold's rows the fit refuses: the validation choice, said
        log(f"warning: no cross-fitted k ({exc}); k is chosen on the validation split")
        return (
            *choose_rule_and_k(val_by_rule, fallback),
            {**validation, "cross_fit_failed": str(exc)},
        )
    choice = {"method": "cross-fitted", "folds": folds, "rows": pooled, "accuracy": curve}
    return (*choose_rule_and_k(curve, fallback), choice)


def folds_for(setting: str | int, n_validation: int, n_pooled: int) -> int:
    """How many folds cross-fit the k curve: the setting's number (0: none, the validation
    split's curve), or for "auto" CROSS_FIT_FOLDS when the validation split has fewer than
    CROSS_FIT_BELOW_VALIDATION rows and the pool (training + validation rows) at most
    CROSS_FIT_MAX_ROWS, else 0."""
    if setting != "auto":
        return int(setting)
    small = n_validation < CROSS_FIT_BELOW_VALIDATION and n_pooled <= CROSS_FIT_MAX_ROWS
    return CROSS_FIT_FOLDS if small else 0


def fold_of(y: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """(M,) the fold (0 .. folds - 1) of each row: each class's rows in a random order (from
    ``seed``) are dealt to the folds in turn, from a random first fold, so that every fold
    holds floor or ceil(M_c / folds) rows of class c. y: (M,) class indices."""
    rng = np.random.default_rng(seed)
    fold = np.empty(len(y), dtype=np.int64)
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        fold[rows] = (np.arange(len(rows)) + rng.integers(folds)) % folds
    return fold


def cross_fitted_accuracies(
    make_estimator: Callable,
    X: np.ndarray | sp.csr_matrix,
    y: np.ndarray,
    n_classes: int,
    ks: tuple[int, ...],
    rules: tuple[str, ...],
    folds: int,
    seed: int,
) -> dict[str, dict[int, float]]:
    """{rule: {k: accuracy}} of out-of-fold votes over every row of X (M, D) (dense or
    CSR), y (M,) class indices: each fold's rows vote among the other folds' rows, in the
    map ``make_estimator()`` fits on those other folds (its convergence warnings are the
    main fit's to report, not these). Only the ks every fold's references (at least k of
    them) can answer are scored. ValueError naming the fold when a fold's fit refuses its
    rows (say, features constant over them)."""
    fold = fold_of(y, folds, seed)
    fewest_references = min(np.count_nonzero(fold != f) for f in range(folds))
    ks = tuple(k for k in ks if k <= fewest_references)
    right = {rule: dict.fromkeys(ks, 0) for rule in rules}  # right votes per rule and k
    for f in range(folds):
        held, kept = np.flatnonzero(fold == f), np.flatnonzero(fold != f)
        estimator = make_estimator()
        # SIGINT / SIGTERM are held to the end of a fit's iteration (the fit raises it there):
        # raised anywhere, they could leave the fit's threads mid-work as the process ends
        with warnings.catch_warnings(), holding_interrupts(None) as hold:
            warnings.simplefilter("ignore")
            try:
                estimator.fit(X[kept], y[kept])
            except ValueError as exc:  # rows of the fold the fit refuses: which fold, and why
                raise ValueError(
                    f"the fit of fold {f + 1} of {folds} refused its rows: {exc}"
                ) from exc
        if hold.signum is not None:  # held past a fit that ended first: raised between folds
            raise Interrupted(hold.signum)
        z = estimator.transform(X)  # (M, d) float32: x @ projection.T + offset, as served
        by_rule = knn_accuracies_by_rule(z[kept], y[kept], z[held], y[held], n_classes, ks, rules)
        for rule, by_k in by_rule.items():
            for k, accuracy in by_k.items():
                right[rule][k] += round(accuracy * len(held))
    return {rule: {k: right[rule][k] / len(y) for k in ks} for rule in rules}
