"""Learned reference sets: prototypes trained with NCA's own objective (Stochastic Neighbor
Compression, Kusner et al. 2014).

M labelled prototypes z_j (M, d) with classes c_j replace the N references. Each training
point u_i = A x_i (N, d) is scored against the prototypes, never against the other points:

    p_ij = exp(-g ||u_i - z_j||^2) / sum_l exp(-g ||u_i - z_l||^2)        (softmax over j)
    p_i  = sum_{j : c_j = y_i} p_ij                                    (NCA's p_i, eq 2)

    loss = -(1/N) sum_i log p_i           ("log", NCA's g(A), eq 6)
        or  1 - (1/N) sum_i p_i           ("f", NCA's f(A), eq 3)

With A fixed the parameters are the prototypes; the scale g = exp(s) stays at
scale_factor / (median squared distance from a row to its nearest prototype): the
prototypes are sparser than the points, so the softmax needs its own temperature. It is
not learned: learning it sharpens the softmax until the objective fits the training rows,
and test accuracy drops. The 1-NN rule served does not depend on g. ``PrototypeProblem`` can
also return the gradient in s (``fixed_scale=False``; checked against autograd). In the
joint mode the parameters are the prototypes and the map A (d, D), whose norm is the scale.
Scoring each training row against all the other rows as prototypes (g = 1) is NCA's
objective exactly (p_ii = 0); a test checks it by brute force over pairs.

Cost: one evaluation is O(N M d) time and O(B M) memory (rows in chunks of B, gradients
accumulated chunk by chunk), never N x N.

The starting prototypes are per-class k-means centres in the starting embedding
(``training.references.condense.class_kmeans``), round(N / reduction) in all, shared in
proportion to the classes' sizes, at least one per class
(``training.references.condense.class_budget``).
Full-batch L-BFGS (``training.optim.lbfgs``) moves them; every ``check_every`` iterations
the validation accuracy of the 1-NN rule on the prototypes is measured and the best
parameters are kept (the log loss can fall for long after the 1-NN boundaries stop
improving); a learning checkpointed in a directory (``checkpoint_dir``) resumes there.
The k to serve is chosen afterwards on validation
(``training.evaluation.evaluate.choose_k``), where 1 usually wins.

Tests: ``tests/training/references/test_learned_references.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from training.evaluation.evaluate import K_VALUES, choose_k, knn_accuracies
from training.numerics import zero_subnormal
from training.optim.lbfgs import LBFGS, Evaluation
from training.references.checkpoint import LearningState, PrototypeCheckpoint, learning_key
from training.references.condense import _nearest, class_budget, class_kmeans

LOSSES = ("log", "f")
# L-BFGS ends when a step lowers the loss by at most this fraction, or max |g| is this small
# (scipy's L-BFGS-B factr 1e7 times machine epsilon)
TOLERANCE = 2.2e-9


@dataclass
class PrototypeFit:
    """What ``learn_prototypes`` found.

    prototypes (M, d) float32, labels (M,) int64 class indices, projection (d, D) float64
    the learned map (joint mode; None with A fixed), scale g, the loss at the start and the
    end, iterations and evaluations, the validation 1-NN accuracy at each check
    (iteration, accuracy), the kept iteration, and the seconds taken."""

    prototypes: np.ndarray
    labels: np.ndarray
    projection: np.ndarray | None
    scale: float
    loss_start: float
    loss_end: float
    n_iter: int
    n_eval: int
    history: list = field(default_factory=list)
    best_iter: int = 0
    seconds: float = 0.0
    n_rows: int = 0  # the training rows it learned from
    stop: str | None = None  # why the learning ended (converged, stalled, max_iter, ...)


def initial_prototypes(
    u: np.ndarray, y: np.ndarray, reduction: float | dict, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class k-means centres: u (N, d), y (N,) -> (prototypes (M, d) float64, labels (M,)).
    ``reduction`` is rows per prototype, or the budget itself ({class: prototypes}, every
    class of y in it). A class with no more rows than its budget starts from its rows."""
    budget = reduction if isinstance(reduction, dict) else class_budget(y, reduction)
    centres, labels, _ = class_kmeans(u, y, budget, seed=seed)
    return centres, labels.astype(np.int64)


class PrototypeProblem:
    """theta (flat float64) -> (mean loss, gradient), chunked over the training rows.

    A fixed: theta = [Z (M*d), s]; u = the given embeddings (N, d), g = exp(s).
    Joint:   theta = [Z (M*d), A (d*D)]; u = X A^T for standardised X (N, D), g = 1.
    ``fixed_scale`` keeps s where it is (its gradient is reported as 0).

    The gradient is the closed form (checked against autograd and finite differences in the
    tests). With G_ij = dL/d logit_ij, logit_ij = -g ||u_i - z_j||^2:

        G_ij = w_i (p_ij - q_ij),   q_ij = p_ij [c_j = y_i] / p_i,
        w_i  = 1/N (log loss) or p_i/N (f),
        dL/dz_j = -2g (sum_i G_ij z_j - sum_i G_ij u_i)     (M, d): one GEMM G^T U
        dL/du_i = -2g (sum_j G_ij u_i - sum_j G_ij z_j)     (B, d): one GEMM G Z
        dL/ds   = -g sum_ij G_ij ||u_i - z_j||^2,   dL/dA = (dL/dU)^T X.

    Rows are visited class by class; the prototypes are sorted by class, so a row's own
    class is one block of columns [start_c, end_c) and q needs no mask."""

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        labels: np.ndarray,
        *,
        n_components: int,
        joint: bool,
        loss: str = "log",
        fixed_scale: bool = False,
        chunk_rows: int = 1024,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        labels = np.asarray(labels, dtype=np.int64)
        if np.any(np.diff(labels) < 0):
            raise ValueError("the prototypes must be sorted by class")
        y = np.asarray(y, dtype=np.int64)
        if not np.isin(y, labels).all():
            raise ValueError("every class of the training rows needs a prototype")
        self.device, self.dtype, self.loss = torch.device(device), dtype, loss
        order = np.argsort(y, kind="stable")  # rows class by class
        self.x = torch.as_tensor(np.asarray(x)[order], dtype=dtype, device=self.device)
        classes, first = np.unique(y[order], return_index=True)
        bounds = np.r_[first, len(y)]
        self.blocks = [  # (rows of class c, its prototype columns)
            (
                slice(int(bounds[i]), int(bounds[i + 1])),
                slice(int(np.searchsorted(labels, c)), int(np.searchsorted(labels, c, "right"))),
            )
            for i, c in enumerate(classes)
        ]
        self.n, self.m, self.d, self.joint = len(y), len(labels), n_components, joint
        self.chunk_rows, self.fixed_scale, self.n_eval = chunk_rows, fixed_scale, 0

    def split(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, float]:
        """theta -> (prototypes (M, d), A (d, D) or None, scale g)."""
        z = theta[: self.m * self.d].reshape(self.m, self.d)
        if self.joint:
            return z, theta[self.m * self.d :].reshape(self.d, -1), 1.0
        return z, None, float(np.exp(theta[-1]))

    def loss_and_grad(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        self.n_eval += 1
        z_np, a_np, g = self.split(theta)
        z = torch.as_tensor(z_np, dtype=self.dtype, device=self.device)  # (M, d)
        a = None if a_np is None else torch.as_tensor(a_np, dtype=self.dtype, device=self.device)
        grad_z = torch.zeros_like(z, dtype=torch.float64)
        grad_a = None if a is None else torch.zeros_like(a, dtype=torch.float64)
        total, grad_s = 0.0, 0.0
        for rows, same in self.blocks:
            for start in range(rows.start, rows.stop, self.chunk_rows):
                x = self.x[start : min(start + self.chunk_rows, rows.stop)]  # (B, d|D)
                u = x if a is None else x @ a.T  # (B, d)
                part, gz, gu, gs = chunk_terms(
                    u,
                    z,
                    same,
                    g,
                    self.loss,
                    self.n,
                    want_u=a is not None,
                    want_s=a is None and not self.fixed_scale,
                )
                total += part
                grad_z += gz
                grad_s += gs
                if a is not None:
                    grad_a += (gu.T @ x).double()  # (d, D)
        if self.loss == "f":
            total += 1.0
        if a is None:
            tail = [0.0 if self.fixed_scale else grad_s]
        else:
            tail = grad_a.cpu().numpy().ravel()
        return total, np.concatenate([grad_z.cpu().numpy().ravel(), tail])


def chunk_terms(u, z, same: slice, g: float, loss: str, n: int, *, want_u=True, want_s=True):
    """One chunk of rows of one class: u (B, d), prototypes z (M, d) whose columns ``same``
    carry the rows' class. Returns (loss part, dL/dZ (M, d) float64, dL/dU (B, d) or None,
    dL/ds or 0) of the mean loss over all n rows (without the constant 1 of the f loss).

    One exp pass over the (B, M) block: p_ij = e_ij / sum_l e_il with e = exp(logit - max);
    log p_i takes the class's own log-sum-exp over its few columns, so it stays finite when
    every same-class e_ij underflows."""
    d2 = ((u * u).sum(1, keepdim=True) - 2.0 * u @ z.T + (z * z).sum(1)).clamp_min_(0.0)
    logits = d2 * (-g)  # (B, M)
    log_same = torch.logsumexp(logits[:, same], 1, keepdim=True)  # (B, 1)
    q = zero_subnormal((logits[:, same] - log_same).exp_())  # (B, M_c) q_ij, class's columns
    top = logits.amax(1, keepdim=True)  # (B, 1)
    p_ij = logits.sub_(top).exp_()  # (B, M) e_ij, in the logits' memory
    total = p_ij.sum(1, keepdim=True)  # (B, 1)
    # no subnormal p_ij (their scaling by w below can still make some where p_i is tiny)
    zero_subnormal(p_ij.div_(total))
    log_p = log_same - top - total.log()  # (B, 1) log p_i
    if loss == "log":
        part, w = -float(log_p.sum()) / n, torch.full_like(log_p, 1.0 / n)
    else:
        p_i = log_p.exp()
        part, w = -float(p_i.sum()) / n, p_i / n
    grad = p_ij.mul_(w)  # (B, M) G = w (p - q)
    grad[:, same] -= w * q
    col = grad.sum(0)  # (M,)
    grad_z = (-2.0 * g) * (col[:, None] * z - grad.T @ u)  # (M, d)
    grad_u = (-2.0 * g) * (grad.sum(1, keepdim=True) * u - grad @ z) if want_u else None
    grad_s = -g * float((grad * d2).sum()) if want_s else 0.0
    return part, grad_z.double(), grad_u, grad_s


def nearest_accuracy(u: np.ndarray, y: np.ndarray, prototypes: np.ndarray, labels) -> float:
    """The 1-NN rule's accuracy on queries u (n, d), y (n,) against the prototypes."""
    if len(u) == 0:
        return float("nan")
    return float(np.mean(labels[_nearest(np.asarray(u, np.float32), prototypes)] == y))


def learn_prototypes(
    x: np.ndarray,
    y: np.ndarray,
    *,
    reduction: float | dict,
    projection: np.ndarray | None = None,
    joint: bool = False,
    x_val: np.ndarray | None = None,
    y_val: np.ndarray | None = None,
    loss: str = "f",
    scale_factor: float = 3.0,
    max_iter: int = 200,
    check_every: int = 10,
    patience: int = 5,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    checkpoint_dir: str | Path | None = None,
) -> PrototypeFit:
    """Learn ``class_budget(y, reduction)`` prototypes per class (or a budget {class: count}).

    A fixed (joint=False): x (N, d) are the embeddings u; projection is unused.
    Joint: x (N, D) standardised inputs, projection (d, D) the starting map A (the fitted
    NCA map); both A and the prototypes move. x_val / y_val (validation rows in the same
    space as x) choose the kept iteration by 1-NN accuracy on the prototypes.

    The loop: L-BFGS (``training.optim.lbfgs``) one step at a time, at most ``max_iter``
    steps and 2 max_iter evaluations; every ``check_every`` steps the validation check,
    ending after ``patience`` checks without a gain. With ``checkpoint_dir``, its state is
    saved there (``training.references.checkpoint``) and a learning found there resumes.
    Deterministic for a seed on CPU, resumed or not (one exception found across processes:
    ``training.references.checkpoint``)."""
    started = time.perf_counter()
    x = np.asarray(x)
    y = np.asarray(y, dtype=np.int64)
    if joint and projection is None:
        raise ValueError("the joint mode needs the starting projection (d, D)")
    z0, labels, theta0 = _starting_point(x, y, reduction, projection, joint, scale_factor, seed)
    problem = PrototypeProblem(
        x,
        y,
        labels,
        n_components=z0.shape[1],
        joint=joint,
        loss=loss,
        fixed_scale=True,
        device=device,
        dtype=dtype,
    )
    tracker = BestOnValidation(problem, x_val, y_val, labels, check_every)
    solver = LBFGS(lambda theta: Evaluation(*problem.loss_and_grad(theta)), tol=TOLERANCE)
    saving = None
    if checkpoint_dir is not None:
        settings = {
            "budget": reduction,
            "joint": joint,
            "loss": loss,
            "scale_factor": scale_factor,
            "max_iter": max_iter,
            "check_every": check_every,
            "patience": patience,
            "seed": seed,
            "device": device,
            "dtype": str(dtype),
        }
        key = learning_key([x, y, x_val, y_val, projection], settings)
        saving = PrototypeCheckpoint(checkpoint_dir, loss, key)
    state = _resumed_or_started(saving, solver, tracker, theta0)
    while state.stop is None:
        evaluations_left = 2 * max_iter - solver.evaluations
        if state.iteration >= max_iter or evaluations_left <= 0:
            state.stop = "max_iter" if state.iteration >= max_iter else "max_evaluations"
        else:
            step = solver.step(state.theta, Evaluation(state.f, state.g), evaluations_left)
            state.theta, state.f, state.g, state.stop = step.x, step.at.f, step.at.g, step.stop
            if step.moved:
                state.iteration += 1
            if step.moved and state.iteration % tracker.check_every == 0:
                tracker.check(state.theta, state.f, state.iteration)
                if state.stop is None and patience and tracker.stale >= patience:
                    state.stop = "stalled"  # no validation gain over ``patience`` checks
        if saving is not None and (state.stop is not None or saving.due()):
            saving.save(_with_solver(state, solver, tracker))
    tracker.check(state.theta, state.f, state.iteration, final=True)
    z, a, scale = problem.split(tracker.best_theta)
    return PrototypeFit(
        prototypes=z.astype(np.float32),
        labels=labels,
        projection=a,
        scale=scale,
        loss_start=float(state.loss_start),
        loss_end=float(tracker.best_f),
        n_iter=int(state.iteration),
        n_eval=solver.evaluations,
        history=tracker.history,
        best_iter=tracker.best_iter,
        seconds=time.perf_counter() - started,
        n_rows=len(y),
        stop=state.stop,
    )


def _resumed_or_started(saving, solver: LBFGS, tracker: BestOnValidation, theta0) -> LearningState:
    """The state a checkpoint saved (the solver's pairs and the checks restored), or the
    start: theta0 evaluated and checked."""
    state = None if saving is None else saving.load()
    if state is not None:
        solver.restore(state.pairs_s, state.pairs_y, state.evaluations)
        tracker.restore(state.checks, state.best_theta)
        return state
    at = solver.start(theta0)
    tracker.check(theta0, at.f, 0)
    empty = np.empty((0, theta0.size))
    return LearningState(theta0, at.f, at.g, empty, empty, 1, 0, None, at.f)


def _with_solver(state: LearningState, solver: LBFGS, tracker: BestOnValidation):
    """``state`` with the solver's pairs and evaluations and the checks, as saved."""
    state.pairs_s, state.pairs_y = solver.pairs_arrays()
    state.evaluations = solver.evaluations
    state.checks, state.best_theta = tracker.state(), tracker.best_theta
    return state


def _starting_point(x, y, reduction, projection, joint, scale_factor, seed):
    """(k-means prototypes (M, d), their labels (M,), theta0). The scale starts at
    g = scale_factor / (median squared distance from a row to its nearest prototype); in the
    joint mode it is folded into A and the prototypes (sqrt(g) A, sqrt(g) z)."""
    u0 = x if not joint else x @ np.asarray(projection, dtype=x.dtype).T  # (N, d)
    z0, labels = initial_prototypes(np.asarray(u0, dtype=np.float64), y, reduction, seed)
    log_scale = _starting_log_scale(u0, z0) + np.log(scale_factor)
    if not joint:
        return z0, labels, np.concatenate([z0.ravel(), [log_scale]])
    root = float(np.exp(0.5 * log_scale))
    a0 = root * np.asarray(projection, dtype=np.float64)
    return z0, labels, np.concatenate([root * z0.ravel(), a0.ravel()])


def _starting_log_scale(u: np.ndarray, prototypes: np.ndarray) -> float:
    """s with g = exp(s) = 1 / (the median squared distance from a point to its nearest
    prototype): the softmax starts neither flat nor hard."""
    rng = np.random.default_rng(0)
    sample = np.asarray(u[rng.permutation(len(u))[:2000]], dtype=np.float64)
    nearest = prototypes[_nearest(sample.astype(np.float32), prototypes.astype(np.float32))]
    median = float(np.median(((sample - nearest) ** 2).sum(1)))
    return float(-np.log(max(median, 1e-12)))


class BestOnValidation:
    """Every ``check_every`` iterations, the validation 1-NN accuracy of the prototypes; the
    parameters with the best so far (the earliest among equals) are kept, with the loss
    there, and ``stale`` counts the checks since the last gain. Without a validation set,
    the last parameters checked are kept."""

    def __init__(self, problem, x_val, y_val, labels, check_every):
        self.problem, self.labels, self.check_every = problem, labels, max(1, check_every)
        self.x_val = None if x_val is None or len(x_val) == 0 else np.asarray(x_val)
        self.y_val = None if y_val is None else np.asarray(y_val, dtype=np.int64)
        self.history: list[tuple[int, float]] = []  # (iteration, accuracy)
        self.best_theta, self.best_iter, self.best, self.best_f, self.stale = None, 0, -1.0, 0.0, 0

    def check(self, theta: np.ndarray, f: float, iteration: int, final: bool = False) -> None:
        """Score theta (its loss f) at ``iteration``; ``final``: the learning's last point,
        not scored again when this iteration was."""
        if self.x_val is None:
            self.best_theta, self.best_iter, self.best_f = np.array(theta, copy=True), iteration, f
            return
        if final and self.history and self.history[-1][0] == iteration:
            return
        z, a, _ = self.problem.split(theta)
        u = self.x_val if a is None else self.x_val @ a.T
        accuracy = nearest_accuracy(u, self.y_val, z.astype(np.float32), self.labels)
        self.history.append((iteration, accuracy))
        if accuracy > self.best:
            self.best_theta, self.best_iter, self.best, self.best_f = (
                np.array(theta, copy=True),
                iteration,
                accuracy,
                f,
            )
            self.stale = 0
        else:
            self.stale += 1

    def state(self) -> dict:
        """What a checkpoint keeps of the checks (``restore`` takes it back; the kept
        parameters travel as an array of their own)."""
        return {
            "history": [[int(i), float(a)] for i, a in self.history],
            "best_iter": int(self.best_iter),
            "best": float(self.best),
            "best_f": float(self.best_f),
            "stale": int(self.stale),
        }

    def restore(self, checks: dict, best_theta: np.ndarray | None) -> None:
        self.history = [(int(i), float(a)) for i, a in checks["history"]]
        self.best_iter, self.best = checks["best_iter"], checks["best"]
        self.best_f, self.stale = checks["best_f"], checks["stale"]
        self.best_theta = None if best_theta is None else np.array(best_theta, dtype=np.float64)


def check_budget(
    y: np.ndarray, n_classes: int, reduction, classes=None, name: str = "--reduction"
) -> float:
    """reduction as a float, or ValueError naming the problem: it must be a number above 1
    (training rows per prototype), and every class must have rows (a class without rows
    cannot have a prototype). A class smaller than its share keeps one prototype
    (``class_budget``). y (N,) class indices in [0, n_classes)."""
    try:
        value = float(reduction)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number > 1, got {reduction!r}") from None
    if not np.isfinite(value) or value <= 1:
        raise ValueError(f"{name} must be a number > 1 (rows per prototype), got {reduction}")
    counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=n_classes)
    names = list(range(n_classes)) if classes is None else list(classes)
    empty = [names[c] for c in np.flatnonzero(counts == 0)]
    if empty:
        raise ValueError(
            f"classes {empty[:10]} have no rows: a learned reference set needs at least one "
            "row of every class"
        )
    return value


def representatives(
    u: np.ndarray, y: np.ndarray, prototypes: np.ndarray, labels: np.ndarray
) -> np.ndarray:
    """(M,) for each prototype, the index of the training row of its class nearest it: the
    real example a neighbour answer names. u (N, d), y (N,), prototypes (M, d), labels (M,)."""
    rows = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        members = np.flatnonzero(y == c)
        mine = np.flatnonzero(labels == c)
        rows[mine] = members[_nearest(prototypes[mine], np.asarray(u[members], np.float32))]
    return rows


def served_k(prototypes, labels, z_val, y_val, n_classes: int, rule: str) -> tuple[int, dict]:
    """(k, {k: validation accuracy}): the k the prototypes serve best on the validation rows
    with the model's rule (1 when it ties or there is no validation split)."""
    if z_val is None or len(z_val) == 0:
        return 1, {}
    ks = tuple(k for k in K_VALUES if k <= len(labels))
    accuracy = knn_accuracies(prototypes, labels, z_val, y_val, n_classes, ks, rule)
    return choose_k(accuracy, fallback=1), accuracy
