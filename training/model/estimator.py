"""``NCA``: a scikit-learn compatible transformer that learns A by NCA.

    from sklearn.pipeline import make_pipeline
    from sklearn.neighbors import KNeighborsClassifier
    from training import NCA

    model = make_pipeline(NCA(n_components=32), KNeighborsClassifier(5)).fit(X, y)

The inputs are standardised inside (``standardize``): transform(x) = ((x - mean_) /
scale_) @ components_.T = x @ projection_.T + offset_, computed by the same float32 function
the service uses. Defaults pick the strategy that suits the data: exact full-batch L-BFGS up
to ``AUTO_EXACT_MAX_SAMPLES`` points; above, candidate sets (O(N K) per pass), then a few
L-BFGS iterations on the exact objective (``exact_finish``).
"""

from __future__ import annotations

import numbers
import os
import warnings

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.validation import check_is_fitted, validate_data
from threadpoolctl import threadpool_limits

from service.core.knn import project
from training.distributed.ranks import (
    ShardedProblem,
    broadcast_from_rank0,
    current_group,
)
from training.model import parameters, preparation
from training.model.initialization import INIT_NAMES
from training.model.plan import FitPlan, is_knca, resolve_plan
from training.objectives.registry import make_objective
from training.optim.adam import run_adam
from training.optim.candidates import audit_disagreement, audit_rows
from training.optim.finish import finish_exactly
from training.optim.lbfgs import run_lbfgs
from training.optim.monitor import Monitor, single_class_result
from training.optim.problem import Problem


class NCA(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """Neighbourhood Components Analysis (Goldberger et al. 2004), memory-bounded, in PyTorch.

    Parameters
    ----------
    n_components : int or None
        d, the embedding dimension; None means d = D (a full transform).
    objective : {"nca", "nca-log", "knca-majority", "knca-majority-log", "knca-all", "knca-all-log"}
        "nca" maximises f(A) = sum_i p_i (expected number correct, eq 3); "nca-log"
        maximises g(A) = sum_i log p_i (eq 6). "knca-*" maximise the exact expected accuracy
        of a kNN vote with k neighbours (Tarlow et al. 2013; see ``training.objectives.knca``):
        "majority" (i's class wins the vote outright) or "all" (all k neighbours agree).
    k : int
        The k of the kNN rule the objective trains for (1 for NCA).
    transformation : {"linear", "diagonal"}
        "linear": A is (d, D) (full when d = D, low-rank when d < D). "diagonal": A = diag(a),
        an axis-aligned scaling (requires d = D).
    init : {"auto", "pca", "lda", "identity", "random"}, ndarray (d, D) or artifact path
    solver : {"auto", "lbfgs", "adam"}
        "auto" is L-BFGS (full batch). "adam" runs mini-batches of ``batch_size`` query rows.
    max_iter : int
        L-BFGS iterations, or Adam epochs.
    tol : float
        Convergence tolerance (L-BFGS ftol/gtol; Adam: relative change of the epoch objective).
    l2 : "auto" or float
        Penalty l2 * ||A||_F^2 added to the (per-point mean) loss; 0 gives scikit-learn's
        unpenalised objective. "auto" is DEFAULT_L2 = 0.03 on the exact objective, chosen by
        cross-validation across data sets (``benchmarks/default_l2.py``): it shrinks the
        directions that do not separate the classes and keeps the map from sharpening
        neighbourhoods on noise. On candidate sets "auto" is 0 unless ``candidate_draws`` >
        0: a penalty widens the neighbourhoods until K nearest candidates per kind hold too
        little of the neighbour mass for the candidate objective to be faithful
        (``history_``'s audit figures show the gap; drawn candidates close it).
        ``l2_`` is the value used.
    n_candidates : "auto", int or None
        None: exact objective (chunks against all points). int K: each point's K nearest
        same-class and K nearest other-class points in the current projection, recomputed
        when they go stale (see ``refresh_tol``). "auto": None up to AUTO_EXACT_MAX_SAMPLES
        points, else AUTO_N_CANDIDATES (32).
    refresh_every : int
        At most this many iterations between candidate refreshes: a backstop for the
        signal ``refresh_tol`` watches, which bounds what stale candidates can cost (the
        candidate objective differs from the exact one only through the mass outside the
        candidates); the cost of other counts is measured in ``benchmarks/README.md``.
    refresh_tol : float or None
        Refresh the candidates sooner, after any iteration in which the neighbour mass
        inside them, sum_{j in C_i} p_ij averaged over a fixed sample of 512 training rows,
        has fallen by more than this fraction of its value at the last refresh: the map has
        moved points that are nobody's candidates into neighbourhoods, where the candidate
        objective cannot see them. None refreshes on the count only. ``history_`` records
        the mass outside (``candidate_outside_mass``).
    candidate_mass : float or None
        Choose K from the data: at each refresh, K per kind is the smallest of
        n_candidates x 1, 2, 4, 8 whose fresh candidate sets hold at least this fraction of
        the neighbour mass on the sample rows (the largest when none does). Overlapping
        classes and label noise keep neighbourhoods wide; a K that leaves most of a point's
        neighbours out optimises something else. None keeps K = n_candidates. ``history_``
        records K (``n_candidates``); ``n_candidates_`` is the K at the end.
    candidate_draws : int
        On candidate sets with NCA's objectives (nca, nca-log): S uniform draws per point and
        kind (same class, other classes) beyond the nearest candidates, redrawn at every
        refresh, each weighted by the number of points it stands for ((n_c - 1) / S or
        (N - n_c) / S; a draw that lands on a nearest candidate is dropped). The candidate
        objective then sees an unbiased estimate of the neighbour mass the nearest
        candidates leave out, and stays faithful where neighbourhoods are too wide for any
        K to hold them; with it, ``l2="auto"`` applies the penalty on candidate sets too.
        Costs 2S more candidates per point. 0 (the default) draws none (when it pays:
        ``benchmarks/README.md``).
    exact_finish : "auto" or int
        After a fit on candidate sets, this many L-BFGS iterations on the exact objective
        (every training point a neighbour; l2 as on the exact objective, so "auto" is
        DEFAULT_L2), from the candidate fit's map, averaged over all training rows or, above
        a row limit, that many evenly spaced query rows: EXACT_FINISH_MAX_ROWS = 65,536 for
        NCA's objectives, KNCA_FINISH_MAX_ROWS = 2,048 for kNCA's (an exact kNCA pair costs
        ~20x an NCA one), so an iteration costs O(min(N, rows) N d). Candidate sets make the
        first, long stage cheap; the finish optimises what the map is judged by, which no
        candidate set can be gamed into, and carries the penalty that nearest candidates
        cannot. "auto" is AUTO_EXACT_FINISH_ITER = 10 for NCA's objectives and
        AUTO_KNCA_FINISH_ITER = 20 for kNCA's after L-BFGS, 0 after Adam; 0 turns it off.
        What it gains and costs is measured in ``benchmarks/README.md`` ("Finishing on the
        exact objective").
        Ignored by exact fits. ``exact_finish_iter_`` is the number run.
    chunk_size : int or None
        Query rows per chunk (None: sized to a 256 MiB working set).
    batch_size, learning_rate : Adam's mini-batch size and step size.
    early_stopping : bool
        Hold out ``validation_fraction`` of the data (stratified) unless ``fit`` gets
        ``X_val``/``y_val``; stop after ``n_iter_no_change`` checks (one every
        ``validation_interval`` iterations) without a better validation kNN accuracy, and
        keep the best transformation.
    validation_k : int, tuple of int or None
        The k of the kNN rule that scores validation: None means ``k``; a tuple scores the
        best accuracy over those k (the training job passes the k values it chooses the
        served k from, so validation scores what will be served).
    validation_rule : {"majority", "soft"}
        The decision rule that scores validation (the rule that will be served).
    standardize : {"auto", "feature", "global", "none"} or bool
        How inputs are standardised with statistics of the training data: "feature" centres
        and scales every feature to unit variance (constant features kept; True means
        this); "global" centres and divides by one shared scale (features keep their
        relative scales, as pixels should); "none" (False) leaves them. "auto" picks
        "feature" or "global" by the kNN accuracy of evenly spaced training rows among the
        others in each (``training.data.datasets.choose_standardizer``); ``standardization_`` says
        which, ``standardization_scores_`` by what.
    warm_start : bool
        If fitted before, start from the previous ``components_`` instead of ``init``
        (the inputs' dimension must match; ``components_`` act on standardised inputs).
    device : "auto", "cpu", "cuda", ...
    random_state : int, Generator or None
    verbose : int
        > 0 prints scikit-learn's verbose table: a line per iteration with the objective
        and the seconds it took (and the validation accuracy when it was measured), then the
        total training time; PCA and LDA initialisations say how long they took.
    callback : callable(transformation, n_iter) or None
        Called after every iteration with the current A raveled, shape (d * D,), and the
        iteration number (scikit-learn's form). ``history_`` keeps the objective, time and
        validation accuracy of every iteration.

    Attributes
    ----------
    components_ : (d, D) the learned A, acting on standardised inputs
    projection_, offset_ : (d, D), (d,) the same map on raw inputs, z = x @ W.T + b
    mean_, scale_ : (D,) the standardisation
    classes_, n_features_in_, n_iter_, converged_, stop_reason_, objective_value_,
    history_, init_used_, best_val_accuracy_, n_candidates_, solver_
    l2_ : float
        The penalty of the objective the map optimised last (``l2="auto"`` resolved:
        DEFAULT_L2 exact, in the exact finish or with drawn candidates, 0 on nearest
        candidates alone without a finish).
    exact_finish_iter_ : int
        Iterations of the exact finish (0 when there was none); included in ``n_iter_``.
        ``converged_`` and ``stop_reason_`` are the candidate stage's (the finish runs a
        fixed budget).
    candidate_warning_ : str or None
        On candidate sets, every ``validation_interval`` iterations ``history_`` also records
        the objective on a fixed sample of 512 training rows exactly and on the candidates,
        and their leave-one-out k-NN accuracy. When the candidate objective rose while the
        exact measure fell from its best, or ends more than ``training.optim.candidates.AUDIT_GAP`` above the
        exact objective, this says so (and a UserWarning is raised).
    """

    def __init__(
        self,
        n_components=None,
        *,
        objective="nca",
        k=1,
        transformation="linear",
        init="auto",
        solver="auto",
        max_iter=100,
        tol=1e-5,
        l2="auto",
        n_candidates="auto",
        refresh_every=50,
        refresh_tol=0.05,
        candidate_mass=0.9,
        candidate_draws=0,
        exact_finish="auto",
        chunk_size=None,
        batch_size=1024,
        learning_rate=0.01,
        early_stopping=False,
        validation_fraction=0.1,
        validation_k=None,
        validation_rule="majority",
        n_iter_no_change=5,
        validation_interval=5,
        standardize="auto",
        warm_start=False,
        device="auto",
        random_state=None,
        verbose=0,
        callback=None,
    ):
        self.n_components = n_components
        self.objective = objective
        self.k = k
        self.transformation = transformation
        self.init = init
        self.solver = solver
        self.max_iter = max_iter
        self.tol = tol
        self.l2 = l2
        self.n_candidates = n_candidates
        self.refresh_every = refresh_every
        self.refresh_tol = refresh_tol
        self.candidate_mass = candidate_mass
        self.candidate_draws = candidate_draws
        self.exact_finish = exact_finish
        self.chunk_size = chunk_size
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.validation_k = validation_k
        self.validation_rule = validation_rule
        self.n_iter_no_change = n_iter_no_change
        self.validation_interval = validation_interval
        self.standardize = standardize
        self.warm_start = warm_start
        self.device = device
        self.random_state = random_state
        self.verbose = verbose
        self.callback = callback

    # ------------------------------------------------------------------ validation

    def _validate_params_against(self, n_samples: int, n_features: int, n_classes: int) -> int:
        """Every parameter against its constraints (``training.model.parameters``), then the
        checks that need the data; returns d (``n_components`` resolved)."""
        parameters.check(self.get_params())
        return self._checked_against_data(n_samples, n_features)

    def _checked_against_data(self, n_samples: int, n_features: int) -> int:
        d = self.n_components
        if d is None:  # as scikit-learn: the rows of an array init, else the input dimension
            # (an init with more rows than X has columns is then refused by initial_components)
            rows = self.init.shape[0] if isinstance(self.init, np.ndarray) else n_features
            d = min(rows, n_features)
        if not parameters.Integer(1).accepts(d):
            raise ValueError(f"n_components={d!r} must be an integer >= 1")
        if d > n_features:
            raise ValueError(
                f"The preferred dimensionality of the projected space `n_components` ({d}) "
                f"cannot be greater than the given data dimensionality ({n_features})!"
            )
        if self.transformation == "diagonal" and d != n_features:
            raise ValueError(
                f"transformation='diagonal' needs n_components = n_features = {n_features}, got {d}"
            )
        if n_samples < 2:
            raise ValueError(f"NCA needs at least 2 samples, got n_samples={n_samples}")
        if self.k > n_samples - 1:
            raise ValueError(f"k={self.k} must be <= n_samples - 1 = {n_samples - 1}")
        if (
            is_knca(self.objective)
            and isinstance(self.n_candidates, int)
            and self.n_candidates < self.k
        ):
            raise ValueError(
                f"n_candidates={self.n_candidates} must be >= k={self.k}: each point needs k "
                "same-class candidates"
            )
        if self.candidate_draws and is_knca(self.objective):
            raise ValueError(
                f"candidate_draws={self.candidate_draws!r} weights the candidates of NCA's "
                f"objectives ('nca', 'nca-log'), not objective={self.objective!r}; use 0"
            )
        for vk in self._validation_ks(n_samples):
            if not parameters.Integer(1).accepts(vk):
                raise ValueError(f"validation_k={vk!r} must be an integer >= 1")
        if isinstance(self.init, (str, os.PathLike)) and str(self.init) not in INIT_NAMES:
            if not os.path.isdir(self.init):
                raise ValueError(
                    f"init={str(self.init)!r} must be one of {INIT_NAMES}, an array of shape "
                    "(n_components, n_features) or an existing artifact directory"
                )
        return int(d)

    def _validation_ks(self, n_references: int) -> tuple:
        """The k values validation scores (at most the number of references)."""
        if self.validation_k is None:
            ks = (self.k,)
        elif isinstance(self.validation_k, (tuple, list)):
            ks = tuple(self.validation_k)
        else:
            ks = (self.validation_k,)
        kept = tuple(k for k in ks if not isinstance(k, numbers.Integral) or k <= n_references)
        return kept or (min(self.k, n_references),)

    # ------------------------------------------------------------------ fitting

    def fit(self, X, y, X_val=None, y_val=None):
        """Learn the transformation from X (N, D) and labels y (N,).

        X_val, y_val: an explicit validation set for early stopping (optional).

        Steps: validate the data and parameters; seed; split off the validation set;
        standardise; initialise A; build the problem (objective over the training points);
        optimise under the monitor (validation, early stopping, callback); store the result.

        Data-parallel: when a ``torch.distributed`` process group is initialised (``torchrun``),
        every rank calls fit with its own row shard: X, y (and X_val, y_val, if any) are rows
        [start, stop) of the global sets in rank order, as ``training.distributed.ranks.shard_bounds``
        cuts them. The standardisation, the initial map, the objective, the gradient and the
        validation accuracy are those of all rows together (``training.distributed.sharded_stats``), and
        every rank ends with the same fitted attributes. No rank holds another's rows.
        """
        group = current_group()
        prep = preparation.prepare(self, X, y, X_val, y_val, group)
        self.plan_ = plan = resolve_plan(self.get_params(), len(prep.y))
        make_problem = self._problem_factory(prep, plan, group)
        problem = make_problem()
        monitor = self._monitor(problem, prep.validate(problem), group)
        # numpy/scipy's BLAS threads (OpenBLAS) spin after each small call of the optimiser and
        # steal the cores from torch's kernels: measured 3x slower fits. One BLAS thread here.
        with threadpool_limits(1, user_api="blas"):
            if len(prep.classes) == 1:  # every neighbour is of the same class: nothing to learn
                result = single_class_result(problem, prep.theta0, monitor)
            else:
                result = self._optimise(problem, prep.theta0, monitor, plan.solver, prep.rng)
            candidate_history, finished_iter = result.history, 0
            if plan.finish_iter and result.stop_reason != "single_class":
                exact = make_problem(l2=plan.finish_l2, n_candidates=None, n_draws=0)
                result, finished_iter = finish_exactly(
                    exact,
                    result,
                    monitor,
                    n_iter=plan.finish_iter,
                    max_rows=plan.finish_max_rows,
                    tol=self.tol,
                    validate=prep.validate(exact),
                    monitor_options=self._monitor_options(group),
                )
        self._store_fit(problem, result, prep, plan, finished_iter, group)
        self._warn_about(result, plan, candidate_history, len(prep.y), group)
        return self

    def _problem_factory(self, prep: preparation.Prepared, plan: FitPlan, group):
        """problem(**overrides) -> the objective over the training points as the plan says
        (sharded across ranks under torchrun), with ``overrides`` for the exact finish."""
        draw_seed = 0  # a seed only when drawing: the generator's stream (Adam's) stays as it was
        if plan.candidate_draws:
            draw_seed = int(prep.rng.integers(2**31 - 1))
            if group.is_distributed:  # every rank draws the same candidates
                seed = torch.tensor([draw_seed], dtype=torch.int64, device=prep.device)
                draw_seed = int(broadcast_from_rank0(seed, group)[0])
        defaults = dict(
            transform=self.transformation,
            n_components=prep.d,
            l2=plan.l2,
            n_candidates=plan.n_candidates,
            n_draws=plan.candidate_draws,
            seed=draw_seed,
            chunk_size=self.chunk_size,
        )
        X = torch.as_tensor(prep.X, dtype=torch.float32, device=prep.device)
        labels = torch.as_tensor(prep.y, dtype=torch.long, device=prep.device)
        objective = make_objective(self.objective, self.k, n_classes=len(prep.classes))

        def make_problem(**overrides):
            kwargs = {**defaults, **overrides}
            if group.is_distributed:
                return ShardedProblem(X, labels, objective, group=group, **kwargs)
            return Problem(X, labels, objective, **kwargs)

        return make_problem

    def _monitor(self, problem, validate, group) -> Monitor:
        return Monitor(
            max_iter=self.max_iter,
            validate=validate,
            components=problem.components,
            audit=self._candidate_audit(problem),
            **self._monitor_options(group),
        )

    def _monitor_options(self, group) -> dict:
        """What every stage's Monitor shares: early stopping, the table, the callback."""
        return dict(
            early_stopping=self.early_stopping,
            interval=self.validation_interval,
            patience=self.n_iter_no_change,
            verbose=bool(self.verbose) and group.rank == 0,
            name=type(self).__name__,
            callback=self.callback,
        )

    def _store_fit(
        self, problem, result, prep: preparation.Prepared, plan: FitPlan, finished_iter, group
    ):
        """The fitted attributes; FloatingPointError instead of a map that is not finite."""
        A = problem.components(result.theta)  # (d, D)
        if not np.isfinite(A).all():  # never hand out a NaN map as a fitted one
            raise FloatingPointError(
                f"[{type(self).__name__}] the learned map A has {int((~np.isfinite(A)).sum())} "
                f"non-finite entries after {result.n_iter} iterations (solver={plan.solver!r}, "
                f"objective={self.objective!r}); nothing was fitted"
            )
        mean, scale = prep.mean, prep.scale
        self.components_ = A
        self.mean_, self.scale_ = mean, scale
        self.projection_ = (A / scale[None, :]).astype(np.float32)
        self.offset_ = (-(mean / scale) @ A.T).astype(np.float32)
        self.classes_ = prep.classes
        self.n_iter_ = result.n_iter
        self.converged_ = result.converged
        self.stop_reason_ = result.stop_reason
        self.objective_value_ = result.objective
        self.history_ = result.history
        self.best_val_accuracy_ = result.best_val_accuracy
        self.init_used_ = prep.init_used
        self.n_candidates_ = problem.n_candidates  # K at the end (the watch may change it)
        finished = plan.finish_iter and result.stop_reason != "single_class"
        self.l2_ = float(plan.finish_l2 if finished else plan.l2)  # of the objective optimised last
        self.exact_finish_iter_ = finished_iter
        self.solver_ = plan.solver
        self.device_ = str(prep.device)
        self.fit_seconds_ = result.seconds
        self.n_evaluations_ = result.n_evaluations
        self.world_size_ = group.world_size
        self.distributed_backend_ = group.backend

    def _warn_about(self, result, plan: FitPlan, candidate_history, n_total: int, group):
        """The candidate audit's verdict (``candidate_warning_``) and non-convergence, as
        warnings on rank 0."""
        self.candidate_warning_ = None
        if plan.n_candidates is not None:
            self.candidate_warning_ = audit_disagreement(
                candidate_history, len(audit_rows(n_total)), self.objective
            )
            if self.candidate_warning_ and group.rank == 0:
                warnings.warn(self.candidate_warning_, UserWarning, stacklevel=3)
        if not result.converged and group.rank == 0:
            warnings.warn(
                f"[{type(self).__name__}] NCA did not converge in max_iter={self.max_iter} "
                f"iterations (stop reason: {result.stop_reason}); increase max_iter or tol",
                ConvergenceWarning,
                stacklevel=3,
            )

    @staticmethod
    def _candidate_audit(problem):
        """theta -> the audit figures (``Problem.audit``) on a fixed sample of training rows,
        when the objective is evaluated on candidate sets; None in exact mode."""
        if problem.n_candidates is None:
            return None
        rows = torch.as_tensor(audit_rows(problem.n_samples), device=problem.X.device)
        return lambda theta: problem.audit(theta, rows)

    def _optimise(self, problem, theta0, monitor, solver, rng):
        if solver == "lbfgs":
            return run_lbfgs(
                problem,
                theta0,
                max_iter=self.max_iter,
                tol=self.tol,
                monitor=monitor,
                refresh_every=self.refresh_every,
                refresh_tol=self.refresh_tol,
                target_mass=self.candidate_mass,
            )
        return run_adam(
            problem,
            theta0,
            max_iter=self.max_iter,
            tol=self.tol,
            monitor=monitor,
            learning_rate=self.learning_rate,
            batch_size=self.batch_size,
            rng=rng,
            refresh_every=self.refresh_every,
            refresh_tol=self.refresh_tol,
            target_mass=self.candidate_mass,
        )

    def transform(self, X):
        """z = x @ projection_.T + offset_ (float32), the same function the service uses."""
        check_is_fitted(self, "projection_")  # set once the optimiser has succeeded
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        return project(X, self.projection_, self.offset_)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.required = True
        tags.transformer_tags.preserves_dtype = ["float32"]
        return tags

    @property
    def _n_features_out(self):
        return self.components_.shape[0]
