"""Problems and references the training tests share, in one place (no test module imports
another): small data sets with known structure, brute-force references for the objectives,
and the cases the data-parallel and CUDA tests evaluate on every path."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import torch

from training import NCA
from training.model.options import with_options
from training.numerics import shard_bounds
from training.objectives.registry import make_objective
from training.optim.adam import AdamEpochs
from training.optim.lbfgs import LBFGS, ProblemLoss
from training.optim.problem import Problem
from training.optim.sharded_problem import ShardedProblem

# ---------------------------------------------------------------- data sets


def blobs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    means = rng.normal(0, 1.0, (4, 6))
    y = rng.integers(0, 4, n)
    return means[y] + rng.normal(0, 1.0, (n, 6)), y


def hard_noisy(n=1500, n_features=40, n_informative=8, seed=0):
    """Five overlapping classes, signal in ``n_informative`` of ``n_features`` dimensions,
    25% of the labels resampled."""
    rng = np.random.default_rng(seed)
    means = np.zeros((5, n_features))
    means[:, :n_informative] = rng.normal(0, 1.05, (5, n_informative))
    truth = rng.integers(0, 5, n)
    X = means[truth] + rng.normal(0, 1.0, (n, n_features))
    y = np.where(rng.random(n) < 0.25, rng.integers(0, 5, n), truth)
    return X, y


def fit_history(X, y, **params):
    """A candidate-set fit audited at every iteration, without the exact finish, from the
    initial map as built (these tests study what the candidate objective and its watch do on
    their own: a start at the calibrated scale is softer, and 8 candidates hold less of each
    neighbourhood from the first iteration on, whatever the watch does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(
            n_components=8,
            n_candidates=8,
            max_iter=20,
            random_state=0,
            options=dict(
                validation_interval=1, exact_finish=0, init_scale=1.0, stop_stalled_stages=False
            ),
        )
        return model.set_params(**with_options({**model.options, **params})).fit(X, y)


def candidate_gaps(model) -> list[float]:
    """Candidate minus exact objective on the audit sample, per iteration."""
    return [r["sample_candidate_objective"] - r["sample_exact_objective"] for r in model.history_]


# ---------------------------------------------------- brute-force references


def brute_force(dists, labels, own, k, variant):
    """Enumerate every k-subset of neighbours: P(event) under p(s) ∝ prod_{j in s} exp(-d_j)."""
    w = np.exp(-(dists - dists.min()))
    total = good = 0.0
    n_classes = int(max(labels.max(), own)) + 1
    for subset in itertools.combinations(range(len(w)), k):
        weight = float(np.prod(w[list(subset)]))
        total += weight
        votes = np.bincount(labels[list(subset)], minlength=n_classes)
        if variant == "all":
            good += weight * (votes[own] == k)
        else:
            others = np.delete(votes, own)
            good += weight * (votes[own] > others.max())
    return good / total


def brute_force_p(X, y, A):
    """p_ij and p_i straight from eqs 1-2, in float64 with an explicit N x N matrix."""
    Z = X @ A.T
    d2 = ((Z[:, None, :] - Z[None, :, :]) ** 2).sum(-1)
    logits = -d2
    np.fill_diagonal(logits, -np.inf)
    logits -= logits.max(1, keepdims=True)
    p_ij = np.exp(logits)
    p_ij /= p_ij.sum(1, keepdims=True)
    same = y[:, None] == y[None, :]
    p_i = (p_ij * same).sum(1)
    return p_ij, p_i, same


# ------------------------------------- the data-parallel and CUDA cases

OBJECTIVES = ["nca", "nca-log", "knca-majority", "knca-all"]
MODES = {"exact": None, "candidates": 4}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
N, D, DIM, N_CLASSES = 37, 6, 2, 3


def data():
    rng = np.random.default_rng(5)
    y = np.sort(rng.integers(0, N_CLASSES, N))
    y[:3], y[-3:] = 0, 2  # classes 0 and 2 present, each on one rank only
    X = rng.normal(size=(N, D)) + y[:, None] * 0.7
    theta = rng.normal(size=(DIM, D)).ravel() * 0.6
    return X, y, theta


def problem_for(X, y, name, n_candidates, dtype, group=None, chunk_size=None, device="cpu"):
    objective = make_objective(name, k=1 if name.startswith("nca") else 3, n_classes=N_CLASSES)
    kwargs = dict(
        transform="linear", n_components=DIM, n_candidates=n_candidates, chunk_size=chunk_size
    )
    labels = torch.as_tensor(y, device=device)
    if group is None:
        return Problem(torch.as_tensor(X, dtype=dtype, device=device), labels, objective, **kwargs)
    start, stop = shard_bounds(len(X), group.rank, group.world_size)
    shard = torch.as_tensor(X[start:stop], dtype=dtype, device=device)
    return ShardedProblem(shard, labels, objective, group=group, **kwargs)


def evaluate_all(X, y, theta, group=None, device="cpu"):
    """{case: (loss, grad)} for every objective, mode and dtype; plus short fits."""
    out = {}
    for name in OBJECTIVES:
        for mode, n_candidates in MODES.items():
            for dtype_name, dtype in DTYPES.items():
                # chunks of 5 rows: smaller than either shard, and than the chunk default
                problem = problem_for(
                    X, y, name, n_candidates, dtype, group, chunk_size=5, device=device
                )
                if n_candidates is not None:
                    problem.refresh_candidates(theta)
                loss, grad, _ = problem.loss_and_grad(theta)
                out[f"{name}/{mode}/{dtype_name}"] = np.r_[loss, grad]
            # the default chunk (256 rows and more) is larger than either shard
            problem = problem_for(X, y, name, n_candidates, torch.float64, group, device=device)
            if n_candidates is not None:
                problem.refresh_candidates(theta)
            loss, grad, _ = problem.loss_and_grad(theta)
            out[f"{name}/{mode}/float64/default-chunk"] = np.r_[loss, grad]
    for mode, n_candidates in MODES.items():
        problem = problem_for(X, y, "nca", n_candidates, torch.float64, group, device=device)
        # tol=0: 12 iterations on every path, not as many as one summation order needs; the
        # candidate sets refreshed every 4 (L-BFGS forgetting its pairs then, as a fit does)
        out[f"fit/{mode}"] = steps(
            LBFGS(ProblemLoss(problem), 0.0), problem, theta, 12, refresh_every=4
        )
        # Adam on mini-batches of 8 rows: the same seeded batches on every rank, each rank
        # scoring its share of a batch
        problem = problem_for(
            X, y, "knca-majority", n_candidates, torch.float64, group, device=device
        )
        adam = AdamEpochs(problem, 0.05, 8, np.random.default_rng(0), tol=0.0)
        out[f"adam/{mode}"] = steps(adam, problem, theta, 4)
    return out


def steps(solver, problem, theta, n: int, refresh_every: int | None = None) -> np.ndarray:
    """[the steps taken, the map after them] of ``n`` steps of ``solver`` from theta, the
    candidate sets (if any) refreshed before the first and every ``refresh_every`` after."""
    theta = np.asarray(theta, dtype=np.float64).ravel()
    at, taken = None, 0
    for i in range(n):
        if problem.n_candidates is not None and (
            i == 0 or (refresh_every and i % refresh_every == 0)
        ):
            problem.refresh_candidates(theta)
            solver.reset()
            at = None
        at = solver.start(theta) if at is None else at
        step = solver.step(theta, at)
        if not step.moved:
            break
        theta, at, taken = step.x, step.at, taken + 1
    return np.r_[taken, theta]
