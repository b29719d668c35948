"""``FitOptions``: the advanced settings of a fit, in one place.

``NCA``'s constructor takes what decides the model and how long it may run (15 parameters,
with scikit-learn's names where scikit-learn has the concept); everything else a fit can be
told is a field here, passed as ``NCA(options=FitOptions(...))`` or as a dict of the same
names (``NCA(options={"exact_finish": 0})``). The defaults are the measured ones
(``benchmarks/README.md``); a field is worth changing only for the reason its line gives.

    from training import NCA
    from training.model.options import FitOptions

    NCA(n_components=32, options=FitOptions(standardize="global", early_stopping=True))

:func:`fit_settings` merges the constructor's parameters and the options into one namespace,
which is what every step of a fit reads (``parameters.check`` validates it as one table).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any


@dataclass(frozen=True, repr=False)
class FitOptions:
    """The advanced settings of a fit (what each default costs and gains:
    ``benchmarks/README.md``; what "auto" resolves to: ``training.model.plan``).

    The model
        transformation : "linear" (A (d, D)) or "diagonal" (diag(a), d = D).
        standardize : "auto", "feature", "global", "none" (or a bool): per feature, one
            shared scale (pixels), or none; "auto" picks by kNN accuracy on training rows.
        init_scale : "auto" or a factor in [1e-6, 1e6] for the initial map the estimator
            builds ("auto": the one that maximises NCA's log-likelihood along it; 1.0: as
            built, scikit-learn's).
        prototypes : None or a reduction > 1: the joint mode of learned reference sets,
            round(N / prototypes) prototypes learned with the map after the fit.
    The optimiser
        solver : "auto" (full-batch L-BFGS), "lbfgs", or "adam" over mini-batches of
            ``batch_size`` rows at ``learning_rate``.
        exact_finish : "auto" or an integer: L-BFGS iterations on the exact objective after
            a fit on candidate sets (what the map is judged by).
    Candidate sets (fits above ``plan.AUTO_EXACT_MAX_SAMPLES`` points)
        refresh_every, refresh_tol : recompute the sets at least every ``refresh_every``
            iterations, and sooner when their neighbour mass (512 fixed rows) falls by
            ``refresh_tol`` (None: only on the count).
        candidate_mass : at each refresh K is the smallest of n_candidates x 1, 2, 4, 8 whose
            sets hold this fraction of the neighbour mass; None keeps K fixed.
        candidate_search : "auto", "exact" (every pair) or "ivf" (a FAISS inverted file).
        chunk_size : rows per chunk of the exact objective (None: a 256 MiB working set).
    Held-out rows and stages
        early_stopping, validation_fraction, n_iter_no_change, validation_interval : hold
            out a stratified fraction (or use ``fit``'s X_val, y_val), check every
            ``validation_interval`` iterations, stop after ``n_iter_no_change`` checks
            without a better score, keep the best. Held-out rows, a validation split or
            the rows held out of the fit only to judge its stages, are scored by their
            soft-neighbour score (``training.distributed.sharded_stats.soft_neighbour_score``).
        validation_k, validation_rule : the k (or several, the best kept) and the vote a
            validation split's k-NN accuracy is reported with (``val_accuracy``,
            ``best_val_accuracy_``): those that will be served.
        select_stages : judge the maps on held-out rows and return the most trained one
            within the tolerance (1.5 rows' worth) of the best score of the fit
            (``training.model.fitting``, the keep rule; False: the last map).
        stop_stalled_stages : stop a stage after two held-out checks in a row without a gain
            (False: every stage runs its iterations).
        held_out_score : None or a callable ``(A, stage, iteration) -> float`` that judges
            maps in place of the held-out rows' soft-neighbour score, higher better: A (d, D)
            the map on standardised inputs, ``stage`` its stage's name ("exact fit",
            "candidate stage", "exact finish"), ``iteration`` the stage's own count (0: its
            start), given a copy of the map. Where maps are judged (``select_stages`` or
            ``early_stopping``) every check asks it, the keep and stop rules compare its
            numbers with a tolerance of 0, and no training rows are held out of the fit to
            judge it; a validation split's accuracy is still reported. Under torchrun it is
            called on rank 0 alone and its number judges on every rank. A checkpoint tells
            two functions apart by their module and qualified name only.
    Watching
        progress : None or a callable given a ``training.model.fitting.StageProgress`` at each
            stage's start and after each iteration (the CLI's progress bar).

    A search over options takes whole values: ``GridSearchCV(pipe, {"nca__options":
    [{"standardize": "global"}, {"standardize": "none"}]})``; there are no nested
    ``options__name`` parameters.
    """

    transformation: str = "linear"
    standardize: Any = "auto"
    init_scale: Any = "auto"
    prototypes: float | None = None
    solver: str = "auto"
    exact_finish: Any = "auto"
    batch_size: int = 1024
    learning_rate: float = 0.001
    refresh_every: int = 50
    refresh_tol: float | None = 0.05
    candidate_mass: float | None = 0.9
    candidate_search: str = "auto"
    chunk_size: int | None = None
    early_stopping: bool = False
    validation_fraction: float = 0.1
    n_iter_no_change: int = 5
    validation_interval: int = 5
    validation_k: Any = None
    validation_rule: str = "majority"
    select_stages: bool = True
    stop_stalled_stages: bool = True
    held_out_score: Any = None
    progress: Any = None

    def __repr__(self) -> str:
        """Only the fields that differ from their defaults (the estimator's repr shows it)."""
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if _differs(getattr(self, f.name), f.default)
        ]
        return f"FitOptions({', '.join(changed)})"


def _differs(value: Any, default: Any) -> bool:
    """value != default, for values without a single truth value (arrays) too."""
    try:
        return bool(value != default)
    except (TypeError, ValueError):
        return True


OPTION_NAMES = tuple(f.name for f in fields(FitOptions))


def resolve_options(options: Any) -> FitOptions:
    """``NCA(options=...)`` as a FitOptions: None (the defaults), a FitOptions, or a dict of
    its field names. ValueError naming an unknown name and the names there are."""
    if options is None:
        return FitOptions()
    if isinstance(options, FitOptions):
        return options
    if isinstance(options, dict):
        unknown = sorted(str(name) for name in options if name not in OPTION_NAMES)
        if unknown:
            raise ValueError(
                f"options has no setting {', '.join(map(repr, unknown))}; the settings are "
                f"{', '.join(OPTION_NAMES)} (training.model.options.FitOptions)"
            )
        return FitOptions(**options)
    raise ValueError(
        f"options={options!r} must be None, a training.model.options.FitOptions or a dict of "
        "its settings"
    )


def fit_settings(params: dict) -> SimpleNamespace:
    """Every setting of a fit by name: the estimator's ``get_params()`` with its ``options``
    spread out (one flat namespace, what the fit's steps read)."""
    params = dict(params)
    options = resolve_options(params.pop("options", None))
    # getattr, not dataclasses.asdict: asdict deep-copies values (a progress bar and its stream)
    return SimpleNamespace(**params, **{name: getattr(options, name) for name in OPTION_NAMES})


def with_options(flat: dict) -> dict:
    """``NCA``'s keyword arguments from one flat dict of settings (the CLI's): the names of
    FitOptions gathered into ``options``, the rest passed as they are."""
    options = {name: value for name, value in flat.items() if name in OPTION_NAMES}
    params = {name: value for name, value in flat.items() if name not in OPTION_NAMES}
    return {**params, "options": options} if options else params


def validation_ks(settings: SimpleNamespace, n_references: int) -> tuple:
    """The k values held-out rows are scored with (at most the number of references):
    ``validation_k`` (one or several), else the objective's k."""
    if settings.validation_k is None:
        ks = (settings.k,)
    elif isinstance(settings.validation_k, (tuple, list)):
        ks = tuple(settings.validation_k)
    else:
        ks = (settings.validation_k,)
    kept = tuple(k for k in ks if not isinstance(k, numbers.Integral) or k <= n_references)
    return kept or (min(settings.k, n_references),)
