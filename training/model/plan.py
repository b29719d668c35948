"""The fit plan: every "auto" of the estimator resolved once, from the parameters and the
size of the data, into what the fit then does. The estimator keeps it as ``plan_`` and the
training report reads it from there. Tested by ``tests/training/model/test_estimator.py`` and
``tests/training/optim/test_exact_finish.py`` (what "auto" means) through the fitted attributes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

AUTO_EXACT_MAX_SAMPLES = 8192  # n_candidates="auto": exact up to this many points
AUTO_N_CANDIDATES = 32  # ... and K nearest candidates per kind above
# an L-BFGS fit on candidate sets averages its loss over at most this many evenly spaced
# query rows (every point still a neighbour), and keeps and searches candidate sets for them
# only, so that the candidate stage's cost stops growing with N (benchmarks/scale.py);
# 2^17 rows estimate a mean score to about 1e-3
CANDIDATE_QUERY_MAX_ROWS = 2**17
# exact_finish="auto": L-BFGS iterations on the exact objective after a fit on candidate
# sets, started at the penalised loss's best scale (fitting.start_scale); kNCA's exact
# pairs cost ~20x NCA's, so its finish averages over fewer rows and runs longer
# (benchmarks/README.md, "Finishing on the exact objective", "The finish's start scale")
AUTO_EXACT_FINISH_ITER = 5
EXACT_FINISH_MAX_ROWS = 65536
# ... and at most this many (query row, point) pairs per finishing evaluation, so that one
# costs O(FINISH_PAIRS d): the finish's rows shrink as N grows, never below FINISH_MIN_ROWS
# where every point is kept (kNCA, torchrun). Fewer pairs leave the digits' finish worse than
# its start (benchmarks/README.md, "What the exact finish buys")
FINISH_PAIRS = 2**30
FINISH_MIN_ROWS = 1024
# ... and above this many points, NCA's finish is the exact objective on an evenly spaced
# sample of this many of them rather than on all N with fewer query rows, which fitted its
# few rows and was undone at 1M points (benchmarks/README.md, "The finish on a sample of
# the points"). Not under torchrun (each rank's shard is contiguous, the sample is not),
# nor for kNCA's finish (not measured)
FINISH_MAX_POINTS = 2**16
# the finish's L-BFGS evaluations are bounded too (a line search that overshoots cannot make
# it cost more): at most FINISH_EVALUATIONS_PER_ITER per iteration, plus one
FINISH_EVALUATIONS_PER_ITER = 2
AUTO_KNCA_FINISH_ITER = 20
KNCA_FINISH_MAX_ROWS = 2048
# what l2="auto" means on the exact objective (0 on candidate sets); the l2 parameter's
# docstring says why, benchmarks/results/default_l2.json how it was chosen
DEFAULT_L2 = 0.03


@dataclass(frozen=True)
class FitPlan:
    """What one fit does, "auto" resolved."""

    solver: str  # "lbfgs" or "adam"
    n_candidates: int | None  # K nearest candidates per kind; None: the exact objective
    candidate_rows: int | None  # query rows of the candidate stage, at most (None: all)
    l2: float  # the penalty of the first stage's objective
    finish_iter: int  # exact L-BFGS iterations after a candidate fit (0: none)
    finish_l2: float  # the penalty of the exact finish
    finish_max_rows: int  # query rows a finishing iteration averages over, at most
    finish_points: int | None  # the finish's points: an evenly spaced sample (None: all)
    finish_max_evaluations: int  # the finish's objective evaluations, at most
    # the finish starts at its penalised loss's best scale (fitting.start_scale): NCA's
    # objectives with a penalty (kNCA's start scale is not measured)
    finish_scaled_start: bool

    def describe(self) -> dict:
        return asdict(self)


def is_knca(objective: str) -> bool:
    """Whether the objective is one of kNCA's (``knca-*``) rather than NCA's."""
    return objective.startswith("knca")


def resolve_plan(params: dict, n_samples: int, distributed: bool = False) -> FitPlan:
    """The plan for the estimator's ``params`` (``get_params()``) on ``n_samples`` points
    (over every rank when ``distributed``).

    n_candidates "auto": exact up to AUTO_EXACT_MAX_SAMPLES points, else AUTO_N_CANDIDATES.
    candidate_rows: CANDIDATE_QUERY_MAX_ROWS for an L-BFGS fit on candidate sets in one
    process on more points than that (Adam's batches need every row's set; under torchrun
    each rank's loss runs over its own shard), else None.
    l2 "auto": DEFAULT_L2 on the exact objective, 0 on candidate sets (a penalty there pulls
    the candidate objective away from the exact one); the exact finish always carries
    DEFAULT_L2. exact_finish "auto":
    none after an exact fit or after Adam, else AUTO_EXACT_FINISH_ITER (NCA's objectives)
    or AUTO_KNCA_FINISH_ITER (kNCA's). The finish's points: all, or for NCA's objectives in
    one process above FINISH_MAX_POINTS points an evenly spaced sample of that many; its
    rows: FINISH_PAIRS over the points it has, within FINISH_MIN_ROWS and the objective's
    most.
    """
    n_candidates = params["n_candidates"]
    if n_candidates == "auto":
        n_candidates = None if n_samples <= AUTO_EXACT_MAX_SAMPLES else AUTO_N_CANDIDATES
    solver = "lbfgs" if params["solver"] == "auto" else params["solver"]
    sampled = n_candidates is not None and solver == "lbfgs" and not distributed
    candidate_rows = CANDIDATE_QUERY_MAX_ROWS if sampled else None
    if n_samples <= CANDIDATE_QUERY_MAX_ROWS:
        candidate_rows = None
    knca = is_knca(params["objective"])
    if isinstance(params["l2"], str):  # "auto"
        l2 = DEFAULT_L2 if n_candidates is None else 0.0
        finish_l2 = DEFAULT_L2
    else:
        l2 = finish_l2 = float(params["l2"])
    finish = params["exact_finish"]
    if n_candidates is None:
        finish_iter = 0
    elif isinstance(finish, str):  # "auto"
        auto = AUTO_KNCA_FINISH_ITER if knca else AUTO_EXACT_FINISH_ITER
        finish_iter = auto if solver == "lbfgs" else 0
    else:
        finish_iter = int(finish)
    max_rows = KNCA_FINISH_MAX_ROWS if knca else EXACT_FINISH_MAX_ROWS
    sample_finish = finish_iter > 0 and not knca and not distributed
    finish_points = FINISH_MAX_POINTS if sample_finish and n_samples > FINISH_MAX_POINTS else None
    finish_rows = max(FINISH_MIN_ROWS, FINISH_PAIRS // max(1, finish_points or n_samples))
    return FitPlan(
        solver=solver,
        n_candidates=n_candidates,
        candidate_rows=candidate_rows,
        l2=l2,
        finish_iter=finish_iter,
        finish_l2=finish_l2,
        finish_max_rows=min(max_rows, finish_rows),
        finish_points=finish_points,
        finish_max_evaluations=FINISH_EVALUATIONS_PER_ITER * finish_iter + 1,
        finish_scaled_start=finish_l2 > 0 and not knca,
    )
