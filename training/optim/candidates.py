"""Keeping candidate sets honest: the audit of the neighbour mass they leave out on
fixed rows, and ``CandidateWatch``, which decides when to recompute them."""

from __future__ import annotations

import numpy as np
import torch

from training.numerics import evenly_spaced_rows
from training.optim.problem import Problem

AUDIT_ROWS = 512  # query rows whose exact objective is tracked when training on candidates
# the exact sample objective may fall this far below its best (absolute, and relative to its
# range over the fit) before the candidate objective is called misleading
AUDIT_DROP_ABS, AUDIT_DROP_REL = 0.01, 0.10
# ... and the candidate objective may stand this far above the exact one on the sample at the
# end of the fit. For f, 0.1 of a probability: about 10% of the neighbour mass off the
# candidates, which faithful fits stay well below and gamed ones exceed
# (benchmarks/README.md, "Candidate sets against exact training"). For g, 0.25 nats of mean
# log-probability: the candidates overstate p_i by a factor of 1.28, more than the
# -log 0.855 = 0.16 that the candidate watch alone allows.
AUDIT_GAP = {"nca": 0.10, "nca-log": 0.25}


MAX_CANDIDATES_GROWTH = 8  # candidates per kind grow to at most 8x the requested K


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
        self.changes: list[float] = []  # the fraction of sets each refresh changed
        self.replaced: list[float] = []  # ... and the share of candidate entries it replaced
        self.search_mass_ratios: list[float | None] = []  # ... and the search's measured mass

    def refresh(self, theta: np.ndarray) -> float:
        """Recompute the candidates at theta (choosing K first when adaptive); return the
        fraction of points whose set changed."""
        inside = None  # mass inside the new candidates, when the choice of K measured it
        k = None  # K for the new sets (None: as it is)
        if self.target_mass is not None:
            masses = self.problem.fresh_inside_mass(theta, self.rows, self.ladder)
            chosen = next(
                (i for i, m in enumerate(masses) if m >= self.target_mass), len(masses) - 1
            )
            k, inside = self.ladder[chosen], masses[chosen]
        changed = self.problem.refresh_candidates(theta, n_candidates=k)
        self.sizes.append(self.problem.n_candidates)
        self.changes.append(float(changed))
        self.replaced.append(float(self.problem.replaced_share))
        self.search_mass_ratios.append(self.problem.search_mass_ratio)
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
    rows = problem.sample_rows(AUDIT_ROWS)
    return CandidateWatch(problem, rows, refresh_every, refresh_tol, target_mass)


def candidate_audit(problem: Problem):
    """theta -> the audit figures (``Problem.audit``) on a fixed sample of training rows,
    when the objective is evaluated on candidate sets; None in exact mode."""
    if problem.n_candidates is None:
        return None
    rows = problem.sample_rows(AUDIT_ROWS)
    return lambda theta: problem.audit(theta, rows)
