"""Optimisers for neighbourhood objectives: full-batch L-BFGS and mini-batch Adam.

Both minimise the loss

    L(A) = -(1 / |rows|) sum_{i in rows} score_i(A) + l2 * ||A||_F^2

where score_i is the objective's per-point score (see ``training.objectives.nca``) evaluated
exactly (chunks against all points) or on candidate sets. With candidate sets the
optimisation runs in rounds: candidates are recomputed in the current projection, then the
optimiser runs until the :class:`CandidateWatch` finds them stale, or for at most
``refresh_every`` iterations (L-BFGS restarts each round, since its curvature pairs belong
to the previous objective).

A :class:`Monitor` sees every iteration: it prints the verbose table, records the history,
and implements early stopping on validation kNN accuracy (keeping the best parameters).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import minimize

from service.core.knn import decide
from training.numerics import EXP_FLOOR, evenly_spaced_rows
from training.objectives.nca import NCAObjective, Objective
from training.objectives.neighbourhood import (
    nearest_candidates,
    objective_sum,
    sampled_candidates,
    with_sampled_candidates,
)


def _logsumexp_at(log_p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log sum_{j in index_i} exp(log_p[i, j]): log_p (B, N), index (B, M) with -1 padding
    -> (B,)."""
    picked = log_p.gather(1, index.clamp_min(0)).masked_fill(index < 0, float("-inf"))
    return torch.logsumexp(picked, dim=1)


SAMPLE_BLOCK_ROWS = 64


def _log_neighbour_probabilities(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """log p_ij (B, N) for sample rows (B,) of embeddings z (N, d): log softmax over j != i
    of -||z_i - z_j||^2.

    Computed as the softmax of L'_ij = 2 z_i.z_j - ||z_j||^2 (L_ij plus the per-row constant
    ||z_i||^2, which softmax ignores): one GEMM with a bias row, then in-place passes, with
    the exponents floored at EXP_FLOOR (exp's subnormal path is ~8x slower on CPU, and a
    trained map puts most points far beyond exp's range). Entries below the floor come out
    as log p_ij >= EXP_FLOOR - log-sum, about 1e-35 too large, far below float precision of
    any mass these are summed into."""
    log_p = torch.addmm(-(z * z).sum(1)[None, :], z[rows], z.T, alpha=2.0)  # (B, N)
    log_p[torch.arange(rows.shape[0], device=z.device), rows] = float("-inf")
    m = log_p.amax(1, keepdim=True)  # (B, 1)
    log_p.sub_(m)
    total = torch.cat(  # (B, 1); row blocks keep the exp temporaries small (cache, no mmap)
        [
            block.clamp_min(EXP_FLOOR).exp_().sum(1, keepdim=True)
            for block in log_p.split(SAMPLE_BLOCK_ROWS)
        ]
    )
    return log_p.sub_(torch.log(total))


class Problem:
    """Data, objective and parametrisation: theta (flat float64) -> loss and gradient.

    X: (N, D) standardised inputs on ``device``; labels: (N,) int64 class indices.
    transform 'linear': theta holds A (d, D), Z = X A^T; 'diagonal': theta holds a (D,), Z = X * a.
    """

    def __init__(
        self,
        X: torch.Tensor,
        labels: torch.Tensor,
        objective: Objective,
        *,
        transform: str,
        n_components: int,
        l2: float = 0.0,
        n_candidates: int | None = None,
        n_draws: int = 0,
        seed: int = 0,
        chunk_size: int | None = None,
    ):
        self.X = X
        self.labels = labels
        self.objective = objective
        self.transform = transform
        self.n_components = n_components
        self.l2 = float(l2)
        self.n_candidates = n_candidates
        # per kind and point, uniform draws beyond the nearest candidates that estimate the
        # mass those leave out (NCA objectives; 0: the nearest candidates only)
        self.n_draws = n_draws
        if n_draws and not isinstance(objective, NCAObjective):
            raise ValueError(
                f"n_draws={n_draws}: drawn candidates weight NCA's objectives only, "
                f"not {objective!r}"
            )
        self.generator = torch.Generator(device=X.device).manual_seed(seed)
        self.chunk_size = chunk_size
        self.nearest: torch.Tensor | None = None  # (N, 2K) nearest candidates
        self.candidates: torch.Tensor | None = None  # (N, M) what the objective reads
        self.candidate_log_weights: torch.Tensor | None = None  # (N, M) or None
        # (B,) the query rows the loss averages over (None: all N); neighbours are all points
        self.query_rows: torch.Tensor | None = None
        n_features = X.shape[1]
        self.shape = (n_features,) if transform == "diagonal" else (n_components, n_features)

    @property
    def n_samples(self) -> int:
        return self.X.shape[0]

    def to_tensor(self, theta: np.ndarray, requires_grad: bool = False) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(theta).reshape(self.shape), dtype=self.X.dtype)
        return t.to(self.X.device).requires_grad_(requires_grad)

    def embed(self, params: torch.Tensor) -> torch.Tensor:
        """Z = X A^T (N, d), or X * a for the diagonal transform."""
        if self.transform == "diagonal":
            return self.X * params[None, :]
        return self.X @ params.T

    def components(self, theta: np.ndarray) -> np.ndarray:
        """The (d, D) matrix A for parameters theta."""
        theta = np.asarray(theta, dtype=np.float64).reshape(self.shape)
        return np.diag(theta) if self.transform == "diagonal" else theta

    def find_candidates(self, z: torch.Tensor) -> torch.Tensor:
        """Every point's candidate set in the embedding z (N, d): (N, 2K)."""
        return nearest_candidates(z, self.labels, self.n_candidates)

    def refresh_candidates(self, theta: np.ndarray) -> float:
        """Recompute candidate sets in the current projection, and draw the candidates beyond
        them afresh when ``n_draws``; return the fraction of nearest sets that changed."""
        with torch.no_grad():
            new = self.find_candidates(self.embed(self.to_tensor(theta)))
        old, self.nearest = self.nearest, new
        self.candidates, self.candidate_log_weights = new, None
        if self.n_draws:
            drawn, log_w = sampled_candidates(self.labels, new, self.n_draws, self.generator)
            self.candidates, self.candidate_log_weights = with_sampled_candidates(
                new, drawn, log_w, self.X.dtype
            )
        if old is None or old.shape != new.shape:
            return 1.0
        return float((torch.sort(old, 1).values != torch.sort(new, 1).values).any(1).float().mean())

    def outside_mass(self, theta: np.ndarray, rows: torch.Tensor) -> float:
        """What the candidate objective cannot see, on sample rows (B,): the mean over the
        rows of the neighbour-probability mass that falls outside their candidates,

            1 - sum_{j in C_i} p_ij,   p_ij = softmax_{j != i}(-||z_i - z_j||^2)  (all N points),

        the same weights NCA and kNCA draw neighbours with. Small right after a refresh (the
        candidates are the nearest points); it grows when the map moves points that are
        nobody's candidates into neighbourhoods. O(B N d)."""
        with torch.no_grad():
            z = self.embed(self.to_tensor(theta))
            log_p = _log_neighbour_probabilities(z, rows)  # (B, N)
            inside = torch.exp(_logsumexp_at(log_p, self.nearest[rows]))  # (B,)
        return float((1.0 - inside).clamp_min(0.0).mean())

    def fresh_inside_mass(self, theta: np.ndarray, rows: torch.Tensor, ks: list[int]):
        """For each K in ``ks`` (ascending), the mean over sample rows (B,) of the neighbour
        mass held by their K nearest same-class and K nearest other-class points in the
        current projection: what fresh candidate sets of that size would hold."""
        with torch.no_grad():
            z = self.embed(self.to_tensor(theta))
            log_p = _log_neighbour_probabilities(z, rows)  # (B, N)
            k_max = ks[-1]
            fresh = nearest_candidates(z, self.labels, k_max, rows=rows)  # (B, 2 K_max)
            k_max = fresh.shape[1] // 2  # fewer when N is small
            masses = []
            for k in ks:
                k = min(k, k_max)
                prefix = torch.cat([fresh[:, :k], fresh[:, k_max : k_max + k]], dim=1)
                masses.append(float(torch.exp(_logsumexp_at(log_p, prefix)).mean()))
        return masses

    def audit(self, theta: np.ndarray, rows: torch.Tensor) -> dict[str, float]:
        """What the optimiser improves against what it stands for, on a fixed sample of
        query rows (B,): the objective on the current candidate sets, the exact objective
        (every point a neighbour; NCA objectives, whose fused kernel makes it O(B N d)), and
        the leave-one-out k-NN accuracy of the rows among all training points (majority
        vote, the objective's k). Mean scores per row."""
        n, k = rows.shape[0], self.objective.k
        with torch.no_grad():
            z = self.embed(self.to_tensor(theta))
            out = {
                "sample_candidate_objective": float(
                    objective_sum(
                        z,
                        self.labels,
                        self.objective,
                        rows=rows,
                        candidates=self.candidates,
                        log_weights=self.candidate_log_weights,
                    )
                )
                / n
            }
            if isinstance(self.objective, NCAObjective):
                exact = objective_sum(z, self.labels, self.objective, rows=rows)
                out["sample_exact_objective"] = float(exact) / n
            zq = z[rows]  # (B, d)
            closeness = torch.addmm(-(z * z).sum(1)[None, :], zq, z.T, alpha=2.0)  # (B, N)
            closeness[torch.arange(n, device=z.device), rows] = float("-inf")  # leave i out
            top, idx = torch.topk(closeness, k, dim=1)  # (B, k) nearest first
            dist = ((zq * zq).sum(1, keepdim=True) - top).clamp_min(0.0)  # ||z_i - z_j||^2
        labels = self.labels.cpu().numpy()
        n_classes = int(labels.max()) + 1
        predicted, _ = decide(
            labels[idx.cpu().numpy()], dist.double().cpu().numpy(), n_classes, "majority"
        )
        out["sample_loo_accuracy"] = float(np.mean(predicted == labels[rows.cpu().numpy()]))
        return out

    def objective_total(self, z: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """sum_{i in rows} score_i of embeddings z (N, d) under this problem's objective,
        candidates and chunking; differentiable in z."""
        return objective_sum(
            z,
            self.labels,
            self.objective,
            rows=rows,
            candidates=self.candidates,
            log_weights=self.candidate_log_weights,
            chunk_size=self.chunk_size,
        )

    def mean_score(self, params: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        total = self.objective_total(self.embed(params), rows)
        return total / (self.n_samples if rows is None else rows.shape[0])

    def loss(self, params: torch.Tensor, rows: torch.Tensor | None = None):
        """(loss tensor, mean score as float)."""
        score = self.mean_score(params, rows)
        loss = -score
        if self.l2:
            loss = loss + self.l2 * (params * params).sum()
        return loss, float(score.detach())

    def loss_and_grad(self, theta: np.ndarray) -> tuple[float, np.ndarray, float]:
        params = self.to_tensor(theta, requires_grad=True)
        loss, score = self.loss(params, self.query_rows)
        loss.backward()
        grad = params.grad.detach().cpu().numpy().astype(np.float64).ravel()
        return float(loss.detach()), grad, score


@dataclass
class FitResult:
    theta: np.ndarray
    n_iter: int
    converged: bool
    stop_reason: str  # converged | precision | max_iter | early_stopping | single_class
    objective: float  # mean score per point at the returned parameters' last evaluation
    history: list[dict] = field(default_factory=list)
    best_val_accuracy: float | None = None
    n_evaluations: int = 0
    seconds: float = 0.0
    n_refreshes: int = 0  # candidate-set computations (0 for exact evaluation)


class EarlyStop(Exception):
    pass


AUDIT_ROWS = 512  # query rows whose exact objective is tracked when training on candidates
# the exact sample objective may fall this far below its best (absolute, and relative to its
# range over the fit) before the candidate objective is called misleading
AUDIT_DROP_ABS, AUDIT_DROP_REL = 0.01, 0.10
# ... and the candidate objective may stand this far above the exact one on the sample at the
# end of the fit: 0.1 of a probability for f (about 10% of the neighbour mass off the
# candidates; faithful fits measured <= 0.03, gamed ones 0.15-0.3 in
# benchmarks/candidate_quality.py), 0.25 nats of mean log-probability for g (the candidates
# overstate p_i by a factor of 1.28; the candidate watch alone allows -log 0.855 = 0.16)
AUDIT_GAP = {"nca": 0.10, "nca-log": 0.25}


def audit_rows(n_samples: int) -> np.ndarray:
    """AUDIT_ROWS evenly spaced training rows (all when fewer): deterministic, and spread
    over the classes however the rows are ordered by class."""
    return evenly_spaced_rows(n_samples, AUDIT_ROWS)


def audit_disagreement(
    history: list[dict], n_rows: int = AUDIT_ROWS, objective: str = "nca"
) -> str | None:
    """A warning when, over a candidate-mode fit, the candidate objective and the exact
    measure on the audit sample (the exact objective where it is computed, else the
    leave-one-out k-NN accuracy) disagree; None when they agree. Two ways to disagree:

    - drift: the candidate objective went up while the exact measure came down from its best
      by more than AUDIT_DROP_*: the map pulled points that are not anyone's candidates into
      their neighbourhoods;
    - gap: at the last audit the candidate objective stands more than AUDIT_GAP[objective]
      above the exact one (only where the exact objective is computed): the candidate sets
      hold too little of the neighbour mass for their objective to be the one optimised.
    """
    audited = [r for r in history if "sample_candidate_objective" in r]
    if not audited:
        return None
    advice = (
        "use more candidates (n_candidates, candidate_mass) or exact evaluation (n_candidates=None)"
    )
    candidate = [r["sample_candidate_objective"] for r in audited]
    return _drift(audited, candidate, n_rows, advice) or _gap(
        audited, candidate, n_rows, advice, AUDIT_GAP.get(objective, AUDIT_GAP["nca"])
    )


def _drift(audited: list[dict], candidate: list[float], n_rows: int, advice: str) -> str | None:
    """audit_disagreement's first way: the candidate objective rose, the exact measure fell."""
    if len(audited) < 2:
        return None
    key = "sample_exact_objective" if "sample_exact_objective" in audited[0] else None
    key = key or "sample_loo_accuracy"
    exact = [r[key] for r in audited]
    best, last = max(exact), exact[-1]
    spread = best - min(exact)
    if candidate[-1] <= candidate[0] or best - last <= max(AUDIT_DROP_ABS, AUDIT_DROP_REL * spread):
        return None
    what = "exact objective" if key == "sample_exact_objective" else "leave-one-out k-NN accuracy"
    at = audited[exact.index(best)]["iteration"]
    return (
        f"the candidate-set objective rose from {candidate[0]:.4f} to {candidate[-1]:.4f} while "
        f"the {what} of {n_rows} sampled training points fell from {best:.4f} "
        f"(iteration {at}) to {last:.4f}: the map is optimising the candidate sets, not the "
        f"neighbourhoods; {advice}"
    )


def _gap(
    audited: list[dict], candidate: list[float], n_rows: int, advice: str, limit: float
) -> str | None:
    """audit_disagreement's second way: the candidate objective ends above the exact one."""
    if "sample_exact_objective" not in audited[-1]:
        return None
    exact_last = audited[-1]["sample_exact_objective"]
    gap = candidate[-1] - exact_last
    if gap <= limit:
        return None
    return (
        f"at the end of the fit the candidate-set objective of {n_rows} sampled training "
        f"points is {candidate[-1]:.4f}, {gap:.4f} above their exact objective "
        f"{exact_last:.4f} (more than {limit:g}): the candidate sets hold too little of "
        f"each point's neighbour mass, so the fit optimised another objective; {advice}"
    )


class Monitor:
    """Per-iteration bookkeeping: history, verbose table, early stopping on validation accuracy.

    validate: theta -> validation accuracy (or None when there is no validation set).
    Early stopping checks every ``interval`` iterations and stops after ``patience``
    checks without improvement, keeping the best parameters seen.
    """

    def __init__(
        self,
        *,
        max_iter: int,
        validate: Callable[[np.ndarray], float] | None,
        early_stopping: bool,
        interval: int = 5,
        patience: int = 5,
        verbose: bool = False,
        name: str = "NCA",
        callback: Callable[[np.ndarray, int], None] | None = None,
        components: Callable[[np.ndarray], np.ndarray] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        audit: Callable[[np.ndarray], dict[str, float]] | None = None,
        first_iteration: int = 1,
        tags: dict | None = None,
    ):
        self.clock = clock  # seconds, for the history (injectable for tests)
        # a later stage of one fit numbers its iterations on from the earlier one's and tags
        # its history records (the exact finish after candidate sets: {"stage": ...})
        self.iteration_offset = first_iteration - 1
        self.tags = dict(tags or {})
        # theta -> extra figures recorded on the validation schedule (candidate-mode audit)
        self.audit = audit
        self.validate = validate
        self.early_stopping = early_stopping and validate is not None
        self.interval = max(1, interval)
        self.patience = max(1, patience)
        self.callback = callback
        self.components = components or (lambda theta: np.asarray(theta))
        self.history: list[dict] = []
        self.best_acc = -math.inf
        self.best_theta: np.ndarray | None = None
        self.bad_checks = 0
        self.start = clock()  # a later stage may set it to the first stage's start
        self.stage_start = self.start
        self.verbose = verbose
        self.name = name  # prefixes the verbose lines, as scikit-learn's "[ClassName]"
        self.last_call = self.start
        self.header_printed = False

    def __call__(
        self, iteration: int, theta: np.ndarray, objective: float, figures: dict | None = None
    ) -> None:
        """figures: extra per-iteration values for the history (the candidate watch's)."""
        iteration += self.iteration_offset
        record = {
            "iteration": iteration,
            "objective": objective,
            "seconds": self.clock() - self.start,
            **self.tags,
            **(figures or {}),
        }
        scheduled = iteration % self.interval == 0 or iteration == 1
        if self.audit is not None and scheduled:
            record.update(self.audit(theta))
        if self.validate is not None and scheduled:
            acc = float(self.validate(theta))
            record["val_accuracy"] = acc
            if acc > self.best_acc:
                self.best_acc, self.best_theta, self.bad_checks = acc, theta.copy(), 0
            else:
                self.bad_checks += 1
        self.history.append(record)
        if self.verbose:
            self._print_iteration(iteration, objective, record.get("val_accuracy"))
        if self.callback is not None:  # scikit-learn's form: (A raveled (d * D,), iteration)
            self.callback(self.components(theta).ravel(), iteration)
        if self.early_stopping and self.bad_checks >= self.patience:
            raise EarlyStop

    def _print_iteration(self, iteration: int, objective: float, val_accuracy) -> None:
        """One line per iteration in scikit-learn's verbose table (its header before the
        first), plus the validation accuracy when it was measured."""
        now = self.clock()
        self._print_header()
        line = f"[{self.name}] {iteration:>10} {objective:>20.6e} {now - self.last_call:>10.2f}"
        if val_accuracy is not None:
            line += f"  val_accuracy {val_accuracy:.4f}"
        print(line, flush=True)
        self.last_call = now

    def _print_header(self) -> None:
        if not self.header_printed:
            header = "{:>10} {:>20} {:>10}".format("Iteration", "Objective Value", "Time(s)")
            print(f"[{self.name}]\n[{self.name}] {header}\n[{self.name}] {'-' * len(header)}")
            self.header_printed = True

    def close(self) -> None:
        if self.verbose:
            self._print_header()  # also when the optimiser stopped before one iteration
            now = self.clock()
            if "stage" in self.tags:  # a later stage: its own time and the fit's
                print(
                    f"[{self.name}] The {self.tags['stage']} took {now - self.stage_start:8.2f}s; "
                    f"training took {now - self.start:8.2f}s in all.",
                    flush=True,
                )
            else:
                print(f"[{self.name}] Training took {now - self.start:8.2f}s.", flush=True)


def _finish(problem, monitor, theta, n_iter, stop_reason, objective, n_eval) -> FitResult:
    """The result at the parameters returned: early stopping returns the best validated
    ones, whose objective is then computed afresh (``objective`` is the last iterate's)."""
    monitor.close()
    if monitor.early_stopping and monitor.best_theta is not None:
        if not np.array_equal(monitor.best_theta, theta):
            theta = monitor.best_theta
            if problem.n_candidates is not None:  # the candidates of these parameters
                problem.refresh_candidates(theta)
            with torch.no_grad():
                objective = float(problem.mean_score(problem.to_tensor(theta), problem.query_rows))
            n_eval += 1
    return FitResult(
        theta=np.asarray(theta, dtype=np.float64),
        n_iter=n_iter,
        converged=stop_reason in ("converged", "precision", "early_stopping", "single_class"),
        stop_reason=stop_reason,
        objective=objective,
        history=monitor.history,
        best_val_accuracy=None if monitor.best_theta is None else monitor.best_acc,
        n_evaluations=n_eval,
        seconds=monitor.clock() - monitor.start,
    )


def single_class_result(problem: Problem, theta: np.ndarray, monitor: Monitor) -> FitResult:
    """One class: every point's neighbours share its label, so the objective is constant
    (p_i = 1) and its gradient zero; the initial parameters are the answer (as in
    scikit-learn, which fits a single class without changing the initial transformation)."""
    with torch.no_grad():
        objective = float(problem.mean_score(problem.to_tensor(theta)))
    return _finish(problem, monitor, theta, 0, "single_class", objective, 1)


MAX_CANDIDATES_GROWTH = 8  # candidates per kind grow to at most 8x the requested K


class CandidateWatch:
    """Keeps candidate sets honest: when to recompute them, and how many to keep.

    When: after any iteration in which the neighbour mass inside the candidates
    (1 - ``Problem.outside_mass`` on fixed sample rows) has fallen by more than the
    fraction ``refresh_tol`` of its value right after the last refresh, or after
    ``refresh_every`` iterations, whichever comes first. The fall, not the level, is the
    signal, and it is relative, so that it also acts early in a fit, when the projection is
    still small and the neighbour distribution flat.

    How many: at each refresh, K (per kind) is the smallest of n_candidates x 1, 2, 4, ...
    MAX_CANDIDATES_GROWTH whose fresh sets hold at least ``target_mass`` of the neighbour
    mass on the sample rows (the largest when none does): overlapping classes and label
    noise keep neighbourhoods wide, and a K that ignores most of a point's neighbours
    optimises something else. K comes back down when the map sharpens. None keeps K fixed.
    """

    def __init__(
        self,
        problem: Problem,
        rows: torch.Tensor,
        refresh_every: int,
        refresh_tol: float | None,
        target_mass: float | None = None,
    ):
        self.problem = problem
        self.rows = rows  # (B,) sample rows
        self.refresh_every = refresh_every
        self.refresh_tol = refresh_tol  # None: refresh on the count only
        self.target_mass = target_mass
        base = problem.n_candidates
        self.ladder = [base * 2**i for i in range(MAX_CANDIDATES_GROWTH.bit_length())]
        self.baseline = 1.0  # mass inside the candidates right after the last refresh
        self.since = 0  # iterations since the last refresh
        self.n_refreshes = 0
        self.sizes: list[int] = []  # K chosen at each refresh

    def refresh(self, theta: np.ndarray) -> float:
        """Recompute the candidates at theta (choosing K first when adaptive); return the
        fraction of points whose set changed."""
        inside = None  # mass inside the new candidates, when the choice of K measured it
        if self.target_mass is not None:
            masses = self.problem.fresh_inside_mass(theta, self.rows, self.ladder)
            chosen = next(
                (i for i, m in enumerate(masses) if m >= self.target_mass), len(masses) - 1
            )
            self.problem.n_candidates, inside = self.ladder[chosen], masses[chosen]
        changed = self.problem.refresh_candidates(theta)
        self.sizes.append(self.problem.n_candidates)
        self.since = 0
        self.n_refreshes += 1
        if self.refresh_tol is not None:
            if inside is None:
                inside = 1.0 - self.problem.outside_mass(theta, self.rows)
            self.baseline = inside
        return changed

    def after_iteration(self, theta: np.ndarray) -> tuple[bool, dict]:
        """(whether to refresh now, figures for the history)."""
        self.since += 1
        figures: dict = {"n_candidates": self.problem.n_candidates}
        due = self.since >= self.refresh_every
        if self.refresh_tol is not None:
            mass = self.problem.outside_mass(theta, self.rows)
            figures["candidate_outside_mass"] = mass
            due = due or (1.0 - mass) < self.baseline * (1.0 - self.refresh_tol)
        return due, figures


def candidate_watch(
    problem, refresh_every: int, refresh_tol, target_mass=None
) -> CandidateWatch | None:
    if problem.n_candidates is None:
        return None
    rows = torch.as_tensor(audit_rows(problem.n_samples), device=problem.X.device)
    return CandidateWatch(problem, rows, refresh_every, refresh_tol, target_mass)


def run_lbfgs(
    problem: Problem,
    theta0: np.ndarray,
    *,
    max_iter: int,
    tol: float,
    monitor: Monitor,
    refresh_every: int = 50,
    refresh_tol: float | None = 0.05,
    target_mass: float | None = None,
    candidate_change_tol: float = 0.01,
) -> FitResult:
    """Full-batch L-BFGS-B (scipy) on the problem's loss; rounds when using candidates.

    With candidates, a round ends (and L-BFGS restarts on fresh candidates) when the
    :class:`CandidateWatch` says so; the fit ends when a round converges with candidates
    that hardly changed at its start (fewer than ``candidate_change_tol`` of the points)."""
    theta = np.asarray(theta0, dtype=np.float64).ravel().copy()
    state = {"iter": 0, "score": math.nan, "n_eval": 0, "refresh": False}
    watch = candidate_watch(problem, refresh_every, refresh_tol, target_mass)

    def fun(t):
        loss, grad, score = problem.loss_and_grad(t)
        state["score"] = score
        state["n_eval"] += 1
        if not (math.isfinite(loss) and np.isfinite(grad).all()):
            # L-BFGS would carry a NaN into the parameters and return it as a map
            raise FloatingPointError(
                f"the loss ({loss}) or its gradient ({int((~np.isfinite(grad)).sum())} of "
                f"{grad.size} entries not finite) at evaluation {state['n_eval']} (iteration "
                f"{state['iter']}) of {problem.objective!r} is not finite; nothing was fitted"
            )
        return loss, grad

    def on_iteration(intermediate_result):
        state["iter"] += 1
        theta_now = intermediate_result.x
        figures = {}
        if watch is not None:
            state["refresh"], figures = watch.after_iteration(theta_now)
        try:
            monitor(state["iter"], theta_now, state["score"], figures)
        except EarlyStop:
            state["refresh"] = False
            raise StopIteration from None
        if state["refresh"] and state["iter"] < max_iter:
            raise StopIteration  # end the round: the candidates are stale

    stop_reason = "max_iter"
    while state["iter"] < max_iter:
        changed = 1.0
        if watch is not None:
            changed = watch.refresh(theta)
        state["refresh"] = False
        iter_before = state["iter"]
        result = minimize(
            fun,
            theta,
            jac=True,
            method="L-BFGS-B",
            tol=tol,
            callback=on_iteration,
            options={"maxiter": max_iter - state["iter"]},
        )
        theta = result.x
        if state["refresh"]:
            continue
        if result.status == 99 or "StopIteration" in str(result.message):
            stop_reason = "early_stopping"
            break
        if result.status == 0:
            round_converged = True
            reason = "converged"
        elif result.status == 2 or "ABNORMAL" in str(result.message):
            round_converged = True  # the line search cannot improve at this precision
            reason = "precision"
        else:
            round_converged = False
            reason = "max_iter"
        if watch is None:
            stop_reason = reason
            break
        if round_converged and (changed < candidate_change_tol or state["iter"] == iter_before):
            stop_reason = reason
            break
    result = _finish(
        problem, monitor, theta, state["iter"], stop_reason, state["score"], state["n_eval"]
    )
    result.n_refreshes = 0 if watch is None else watch.n_refreshes
    return result


def run_adam(
    problem: Problem,
    theta0: np.ndarray,
    *,
    max_iter: int,
    tol: float,
    monitor: Monitor,
    learning_rate: float,
    batch_size: int,
    rng: np.random.Generator,
    refresh_every: int = 50,
    refresh_tol: float | None = 0.05,
    target_mass: float | None = None,
) -> FitResult:
    """Mini-batch Adam over query rows; one iteration is one epoch over the rows. With
    candidates, the :class:`CandidateWatch` is asked after every epoch."""
    params = problem.to_tensor(theta0, requires_grad=True)
    optimiser = torch.optim.Adam([params], lr=learning_rate)
    n = problem.n_samples
    batch_size = max(1, min(batch_size, n))
    previous = math.nan
    stop_reason = "max_iter"
    epoch = 0
    n_eval = 0
    score = math.nan
    watch = candidate_watch(problem, refresh_every, refresh_tol, target_mass)
    due = watch is not None
    try:
        for epoch in range(1, max_iter + 1):
            if due:
                watch.refresh(params.detach().cpu().numpy().astype(np.float64))
            order = torch.as_tensor(rng.permutation(n), device=problem.X.device)
            total, count = 0.0, 0
            for start in range(0, n, batch_size):
                rows = order[start : start + batch_size]
                optimiser.zero_grad(set_to_none=True)
                loss, batch_score = problem.loss(params, rows)
                loss.backward()
                optimiser.step()
                n_eval += 1
                total += batch_score * rows.shape[0]
                count += rows.shape[0]
            score = total / count
            theta = params.detach().cpu().numpy().astype(np.float64)
            due, figures = (False, {}) if watch is None else watch.after_iteration(theta)
            monitor(epoch, theta, score, figures)
            if abs(score - previous) <= tol * max(1.0, abs(score)):
                stop_reason = "converged"
                break
            previous = score
    except EarlyStop:
        stop_reason = "early_stopping"
    theta = params.detach().cpu().numpy().astype(np.float64)
    result = _finish(problem, monitor, theta, epoch, stop_reason, score, n_eval)
    result.n_refreshes = 0 if watch is None else watch.n_refreshes
    return result
