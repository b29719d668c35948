"""``NCA``: a scikit-learn compatible transformer that learns A by NCA.

    from sklearn.pipeline import make_pipeline
    from sklearn.neighbors import KNeighborsClassifier
    from training import NCA

    model = make_pipeline(NCA(n_components=32), KNeighborsClassifier(5)).fit(X, y)

The inputs are standardised inside (``standardize``): transform(x) = ((x - mean_) /
scale_) @ components_.T = x @ projection_.T + offset_, computed by the same float32 function
the service uses. Defaults pick the strategy that suits the data: exact full-batch L-BFGS up
to ``AUTO_EXACT_MAX_SAMPLES`` points; above, candidate sets (O(N K) per pass), then a few
L-BFGS iterations on the exact objective (``exact_finish``), which go on past the first
only when it gained on held-out rows.
"""

from __future__ import annotations

import hashlib
import warnings
from functools import partial

import numpy as np
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.validation import check_is_fitted, validate_data
from threadpoolctl import threadpool_limits

from service.core.knn import project
from training.distributed.ranks import agreed_flags, current_group
from training.model import preparation, sparse_input
from training.model.checkpoint import FitCheckpoint, fingerprint
from training.model.fitting import ENDED_AS_MEANT, FitClock, StagedFit, StopReason
from training.model.options import fit_settings
from training.model.plan import FitPlan, resolve_plan
from training.objectives.registry import kernels_used
from training.optim.candidates import audit_disagreement, audit_rows
from training.references.compress import compress, edit_k_for
from training.references.learned import representatives, served_k
from training.state_file import package_version


class NCA(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """Neighbourhood Components Analysis (Goldberger et al. 2004), memory-bounded, in PyTorch.

    Parameters (what "auto" resolves to, and why, is in ``training.model.plan``; what each
    default costs and gains is measured in ``benchmarks/README.md``)
    ----------
    n_components : int or None
        d, the embedding dimension; None means d = D.
    objective : {"nca", "nca-log", "knca-majority", "knca-majority-log", "knca-all", "knca-all-log"}
        nca maximises f(A) = sum_i p_i (eq 3), nca-log g(A) = sum_i log p_i (eq 6); knca-*
        the exact expected accuracy of a k-NN vote won outright ("majority") or with all k
        neighbours agreeing ("all") (Tarlow et al. 2013; ``training.objectives.knca``).
    k : int
        The k of the kNN rule the objective trains for (1 for NCA).
    init : {"auto", "pca", "lda", "identity", "random"}, ndarray (d, D) or artifact path
    max_iter, tol : L-BFGS iterations or Adam epochs; the convergence tolerance.
    l2 : "auto" or float
        Penalty l2 ||A||_F^2 on the per-point mean loss (0: scikit-learn's objective). "auto"
        is DEFAULT_L2 where the objective stays faithful under it (exact, the exact finish),
        else 0 (candidate sets). ``l2_`` is the value of the objective optimised last.
    n_candidates : "auto", int or None
        None: the exact objective (chunks against all points). K: each point's K nearest
        same-class and other-class points in the current projection, recomputed when stale.
    max_seconds : None or float
        The fit's budget in seconds: once spent, the running stage stops after its current
        iteration, later stages are skipped, and the best judged map so far is returned
        (``budget_exhausted_``, ``stop_reason_`` "max_seconds", a ConvergenceWarning).
    warm_start : bool
        Start from the previous ``components_`` (same D).
    device, random_state, verbose, callback
        "auto" is CUDA when available; seed; scikit-learn's verbose table; called after
        every iteration with A raveled (d * D,) and the iteration number.
    options : None, ``training.model.options.FitOptions`` or dict
        The advanced settings, in one documented place: the transformation (linear or
        diagonal), standardisation, the initial scale, learned prototypes, the solver and the
        exact finish, the candidate sets' refresh and search, early stopping and the
        held-out rows, stage selection, a progress callable. None: their measured defaults.

    Attributes
    ----------
    components_ : (d, D) A, acting on standardised inputs
    projection_, offset_ : (d, D), (d,) the same map on raw inputs, z = x @ W.T + b
    mean_, scale_ : (D,) the standardisation
    standardization_, standardization_scores_ : "feature", "global" or "none", and the kNN
        scores of the two that ``standardize="auto"`` chose by (None when it did not choose)
    init_scale_ : float, the factor the initial map was scaled by (``init_scale``)
    plan_ : ``training.model.plan.FitPlan``, every "auto" as this fit resolved it
    classes_, n_features_in_, n_iter_, converged_, stop_reason_, objective_value_, history_,
    init_used_, best_val_accuracy_, kept_iteration_, n_candidates_, solver_, l2_, exact_finish_iter_
        (the finish's iterations are in ``n_iter_``; ``converged_`` is the first stage's)
    prototypes_, prototype_labels_, prototype_rows_ : (M, d) float32 in the learned space,
        (M,) labels, (M,) for each prototype the index in X of the row of its class nearest
        it; None unless ``prototypes`` is set. A 1-NN classifier on them is the compressed
        model: ``KNeighborsClassifier(1).fit(nca.prototypes_, nca.prototype_labels_)``.
    stages_ : list of dict
        For each stage (``training.model.fitting.StageRecord``): its name, seconds,
        iterations, evaluations, refreshes, held-out checks, why it stopped, the factor its
        start map was scaled by (``start_scale``), the score of its start and of its end,
        and which one was kept ("start": the stage was undone);
        ``stage_measure_`` says what the scores are.
    kernels_ : dict
        Which implementation evaluated each objective of the fit ("nca_exact",
        "nca_candidates", "knca"): "c" (the native kernels built at install; for exact NCA
        its row pass, its products in torch), "torch", or "flex" (exact NCA on CUDA);
        report.json records it.
    resumed_stages_ : int
        Stages a ``fit(..., checkpoint=DIR)`` found done in DIR and skipped (0: none).
    resumed_iterations_ : int
        ... and the iterations it found done, those of an exact stage killed mid-way included.
    budget_exhausted_ : bool
        Whether ``max_seconds`` cut the fit short.
    candidate_warning_ : str or None
        On candidates, when the candidate objective rose while the exact one on 512 fixed
        rows fell, or ends above it by more than ``training.optim.candidates.AUDIT_GAP``.
    """

    def __init__(
        self,
        n_components=None,
        *,
        objective="nca",
        k=1,
        init="auto",
        max_iter=100,
        tol=1e-5,
        l2="auto",
        n_candidates="auto",
        max_seconds=None,
        warm_start=False,
        device="auto",
        random_state=None,
        verbose=0,
        callback=None,
        options=None,
    ):
        self.n_components = n_components
        self.objective = objective
        self.k = k
        self.init = init
        self.max_iter = max_iter
        self.tol = tol
        self.l2 = l2
        self.n_candidates = n_candidates
        self.max_seconds = max_seconds
        self.warm_start = warm_start
        self.device = device
        self.random_state = random_state
        self.verbose = verbose
        self.callback = callback
        self.options = options

    # ------------------------------------------------------------------ fitting

    def fit(self, X, y, X_val=None, y_val=None, checkpoint=None):
        """Learn the transformation from X (N, D) and labels y (N,).

        X_val, y_val: an explicit validation set for early stopping (optional).
        checkpoint: a directory where the fit's state is written at the end of each stage, and
        within an exact L-BFGS stage (the exact finish, an exact fit) after an iteration once
        ``fitting.CHECKPOINT_SECONDS`` have passed since the last save, or a signal came
        (``training.model.checkpoint``); a fit of the same data and parameters started with
        it again goes on from there and ends with the same map. ``resumed_stages_`` and
        ``resumed_iterations_`` say how much it found done.

        Steps: prepare (validate the data and parameters, seed, split off the held-out rows,
        standardise, initialise A: ``training.model.preparation``); plan (every "auto"
        resolved: ``training.model.plan``); the first stage and the judged finish
        (``training.model.fitting``); publish the fitted attributes.

        Data-parallel: when a ``torch.distributed`` process group is initialised (``torchrun``),
        every rank calls fit with its own row shard: X, y (and X_val, y_val, if any) are rows
        [start, stop) of the global sets in rank order, as ``training.numerics.shard_bounds``
        cuts them. The standardisation, the initial map, the objective, the gradient and the
        validation accuracy are those of all rows together (``training.distributed.sharded_stats``), and
        every rank ends with the same fitted attributes. No rank holds another's rows.
        """
        group = current_group()
        clock = FitClock(self.max_seconds, agree=partial(agreed_flags, group=group))
        # every setting by name: the constructor's parameters and its options' (checked in
        # preparation as one table of constraints)
        settings = fit_settings(self.get_params())
        prep = preparation.prepare(self, settings, X, y, X_val, y_val, group)
        self.plan_ = plan = resolve_plan(vars(settings), len(prep.y), group.is_distributed)
        saver = None
        if checkpoint is not None:
            # the plan too: what a fit computes can change with it where the settings do not
            # (the plan's constants between two source trees, both versioned "unknown")
            decided = {**vars(settings), "plan": plan.describe()}
            # and the map it starts from: a warm start begins at the last fit's map, where a
            # checkpoint of that same data and settings holds the last fit's own start
            decided["start"] = hashlib.sha256(
                np.ascontiguousarray(prep.theta0).tobytes()
            ).hexdigest()
            key = fingerprint(prep.X, prep.y, prep.X_val, prep.y_val, decided, package_version())
            saver = FitCheckpoint(checkpoint, key, rank=group.rank)
        stages = StagedFit(
            type(self).__name__, settings, prep, plan, group, clock, checkpoint=saver
        )
        # numpy/scipy's BLAS threads (OpenBLAS) spin after each small call of the optimiser and
        # steal the cores from torch's kernels: measured 3x slower fits. One BLAS thread here.
        with threadpool_limits(1, user_api="blas"):
            state = stages.run()
        self.stages_ = stages.describe(state)
        self.resumed_stages_ = stages.resumed_stages
        self.resumed_iterations_ = stages.resumed_iterations
        self.stage_measure_ = stages.measure
        self.budget_exhausted_ = state.budget_exhausted
        self._store_fit(stages, state, prep, plan, group)
        # the whole fit on its clock: preparation, every stage and its judgement (so each
        # stage's seconds in stages_ lie within it; prototypes, when asked for, come after)
        self.fit_seconds_ = clock.elapsed()
        self._warn_about(state, plan, len(prep.y), group)
        self.prototypes_ = self.prototype_labels_ = self.prototype_rows_ = None
        self.prototype_fit_ = None  # a refit without prototypes keeps none of an earlier fit's
        if settings.prototypes is not None:
            _fit_prototypes(self, settings, prep, X, y)
        return self

    def _store_fit(self, stages, state, prep: preparation.Prepared, plan: FitPlan, group):
        """The fitted attributes from the fit's ``state`` (``fitting.FitState``);
        FloatingPointError instead of a map that is not finite."""
        kept = state.kept
        A = stages.components(kept.theta)  # (d, D)
        if not np.isfinite(A).all():  # never hand out a NaN map as a fitted one
            raise FloatingPointError(
                f"[{type(self).__name__}] the learned map A has {int((~np.isfinite(A)).sum())} "
                f"non-finite entries after {state.iterations} iterations (solver={plan.solver!r}, "
                f"objective={self.objective!r}); nothing was fitted"
            )
        self._set_map(A, prep.mean, prep.scale)
        self.classes_ = prep.classes
        self.n_iter_ = state.iterations
        self.stop_reason_ = str(state.fit_stop_reason)
        self.converged_ = state.fit_stop_reason in ENDED_AS_MEANT
        self.objective_value_ = kept.objective
        self.history_ = state.history
        # the validation split's k-NN accuracy at the kept map (which its score chose)
        self.best_val_accuracy_ = stages.validation_accuracy(kept.theta)
        self.kept_iteration_ = kept.iteration  # the map returned: 0 is the initial map
        self.init_used_ = prep.init_used
        self.init_scale_ = prep.init_scale
        self.standardization_ = prep.standardization
        self.standardization_scores_ = prep.standardization_scores
        # K at the end (the watch may change it); the plan's when no candidate stage ran
        self.n_candidates_ = state.n_candidates or plan.n_candidates
        finish = [r for r in state.records if r.stage == "exact finish"]
        # a finish the budget did not skip evaluated the exact objective, and the kept map's
        # objective is the finish's (also after no step: its start's), unless it ended
        # without a gain at its first iteration, which left the stage before's
        ran = bool(finish) and finish[0].stop_reason != StopReason.SKIPPED
        finished = ran and finish[0].stop_reason != StopReason.NO_GAIN
        self.l2_ = float(plan.finish_l2 if finished else plan.l2)  # of objective_value_
        self.exact_finish_iter_ = finish[0].iterations if finish else 0
        self.solver_ = plan.solver
        self.device_ = str(prep.device)
        self.n_evaluations_ = state.evaluations
        self.n_refreshes_ = sum(r.refreshes for r in state.records)  # candidate sets (0: exact)
        self.world_size_ = group.world_size
        # which implementation evaluated each objective: "c", "torch" or "flex" (on CUDA)
        self.kernels_ = kernels_used(
            self.objective,
            exact=plan.n_candidates is None or ran,
            candidates=plan.n_candidates is not None,
            device=str(prep.device),
        )
        self.distributed_backend_ = group.backend

    def _set_map(self, A: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> None:
        """components_ (d, D) and the same map on raw inputs: z = x @ projection_.T + offset_."""
        self.components_ = A
        self.mean_, self.scale_ = mean, scale
        self.projection_ = (A / scale[None, :]).astype(np.float32)
        self.offset_ = (-(mean / scale) @ A.T).astype(np.float32)

    def _warn_about(self, state, plan: FitPlan, n_total: int, group):
        """The candidate audit's verdict (``candidate_warning_``) and non-convergence, as
        warnings on rank 0."""
        self.candidate_warning_ = None
        if plan.n_candidates is not None:
            candidate_history = [r for r in state.history if "stage" not in r]
            self.candidate_warning_ = audit_disagreement(
                candidate_history, len(audit_rows(n_total)), self.objective
            )
            if self.candidate_warning_ and group.rank == 0:
                warnings.warn(self.candidate_warning_, UserWarning, stacklevel=3)
        if state.budget_exhausted and group.rank == 0:
            warnings.warn(
                f"[{type(self).__name__}] the fit's budget max_seconds={self.max_seconds:g} ran "
                "out: the best judged map so far is returned (stages_ says which stages ran "
                "and for how long)",
                ConvergenceWarning,
                stacklevel=3,
            )
        elif not self.converged_ and group.rank == 0:
            warnings.warn(
                f"[{type(self).__name__}] NCA did not converge in max_iter={self.max_iter} "
                f"iterations (stop reason: {self.stop_reason_}); increase max_iter or tol",
                ConvergenceWarning,
                stacklevel=3,
            )

    def transform(self, X):
        """z = x @ projection_.T + offset_ (float32), the same function the service uses;
        sparse rows (CSR, CSC) cost their non-zeros times d (``training.model.sparse_input``)."""
        check_is_fitted(self, "projection_")  # set once the optimiser has succeeded
        X = validate_data(
            self,
            X,
            reset=False,
            accept_sparse=sparse_input.SPARSE_FORMATS,
            dtype=[np.float64, np.float32],
        )
        if sparse_input.is_sparse(X):
            return sparse_input.project(X, self.projection_, self.offset_)
        return project(X, self.projection_, self.offset_)

    def to_onnx(self, path=None, overwrite=False):
        """The fitted map as an ONNX model (``onnx.ModelProto``): input ``x`` (batch, D)
        float32, output ``z`` (batch, d) float32, the same function as :meth:`transform`
        (``service.export.onnx_map``: float64 accumulation, rounded once). Its metadata holds
        the classes, D, d, the objective and the package version. ``path``: also written
        there, whole or not at all, as ``nca-export`` writes (an existing file only with
        ``overwrite``; a directory, a link or a missing folder is a ValueError)."""
        check_is_fitted(self, "projection_")
        # here, not at the top: onnx costs a training job 0.1 s and ~27 MiB it rarely uses
        from service.export.onnx_map import estimator_metadata, map_graph, write_model

        metadata = estimator_metadata(
            np.asarray(self.classes_).tolist(),
            self.n_features_in_,
            self.components_.shape[0],
            self.objective,
        )
        model = map_graph(self.projection_, self.offset_, metadata)
        if path is not None:
            write_model(model, path, overwrite)
        return model

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.required = True
        tags.input_tags.sparse = True  # CSR and CSC rows, never densified
        tags.transformer_tags.preserves_dtype = ["float32"]
        return tags

    @property
    def _n_features_out(self):
        return self.components_.shape[0]


def _fit_prototypes(est: NCA, settings, prep: preparation.Prepared, X, y) -> None:
    """The joint mode: round(N / prototypes) prototypes shared among the classes
    (``training.references.condense.class_budget``) and the map, learned
    together from the NCA map (``training.references.compress``: log loss, the iteration
    with the best validation 1-NN accuracy kept, Wilson editing when validation prefers it)."""
    u = prep.X @ est.components_.T  # (N, d) the NCA embedding editing looks at
    edit_k = 0
    if prep.X_val is not None and len(prep.X_val):
        rule = settings.validation_rule
        full_k, _ = served_k(
            u, prep.y, prep.X_val @ est.components_.T, prep.y_val, len(est.classes_), rule
        )
        edit_k = edit_k_for(full_k)
    result = compress(
        prep.X,
        prep.y,
        reduction=float(settings.prototypes),
        n_classes=len(est.classes_),
        rule=settings.validation_rule,
        edit_k=edit_k,
        x_val=prep.X_val,
        y_val=prep.y_val,
        u=u,
        projection=est.components_,
        joint=True,
        loss="log",
        seed=int(prep.rng.integers(2**31 - 1)),
        device=str(prep.device),
        classes=est.classes_.tolist(),
    )
    fit = result.fit
    est._set_map(fit.projection, prep.mean, prep.scale)
    z = est.transform(X)  # (N, d): every row given, so prototype_rows_ index X
    y_idx = np.searchsorted(est.classes_, np.asarray(y))
    est.prototypes_ = fit.prototypes
    est.prototype_labels_ = est.classes_[fit.labels]
    est.prototype_rows_ = representatives(z, y_idx, fit.prototypes, fit.labels)
    est.prototype_fit_ = result
