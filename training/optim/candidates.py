"""Candidate sets: how they are found, and how they are kept honest.

**Finding them** without an N x N scan: each point's K nearest same-class and K nearest
other-class points in the current embedding, searched approximately in an inverted-file
index (FAISS ``IndexIVFFlat``) when an exact scan would cost too much.

The exact search (``training.objectives.neighbourhood.nearest_candidates``) compares every
point with every other: O(N^2 d), too slow at a million points
(``benchmarks/README.md``, "Training at any N"). An IVF index splits the points into
``nlist`` cells around k-means centroids and compares a query with the points of its
``nprobe`` nearest cells only: O(N (nlist + nprobe N / nlist) d), linear in N for
nlist ~ sqrt(N).

* **Same class**: one index per class over its points, searched by its own points for K + 1
  neighbours (the point itself is dropped); a class of at most ``FLAT_MAX_ROWS`` points is
  searched exactly (``IndexFlatL2``).
* **Other classes**: one index over all points, the points in class order so that a class
  is an id range; a class's points search it with a selector that excludes their own range.

The recall is measured, not assumed: ``held_mass`` compares the neighbour mass, under the
objective's softmax weights, that approximate sets hold with what exact sets hold on sample
rows, and ``CandidateSearch`` doubles ``nprobe`` for the next refresh while that ratio is
below ``MIN_MASS_RATIO``. Below ``APPROX_MIN_SAMPLES`` points, on a CUDA device (where the
exact scan in blocks is fast), and with ``kind="exact"`` the exact search is used.

**Keeping them honest**: the neighbour mass they leave out, measured on AUDIT_ROWS fixed
rows (``Problem.outside_mass``) after every iteration, and ``CandidateWatch``, which decides
from it when to recompute them; ``Problem.audit`` compares the candidate objective with the
exact one on the same rows at the held-out checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import faiss
import numpy as np
import torch

from training.numerics import class_runs, evenly_spaced_rows
from training.objectives.neighbourhood import nearest_candidates

APPROX_MIN_SAMPLES = 50_000  # "auto": exact below this many points
FLAT_MAX_ROWS = 4096  # a class this small is searched exactly
# nlist = LISTS_PER_SQRT * sqrt(n): fewer, larger lists hold more of the exact sets' neighbour
# mass in the same time (on 1M points of benchmarks/scale.py's set at nprobe 16, sqrt(n) lists
# held 0.83 of it, 4 sqrt(n) lists 0.69)
LISTS_PER_SQRT = 1
TRAIN_ROWS_PER_LIST = 64  # k-means sees at most this many points per list
DEFAULT_NPROBE = 16
MAX_NPROBE = 256
MIN_MASS_RATIO = 0.95  # approximate sets must hold this fraction of the exact sets' mass


def _ivf(vectors: np.ndarray, seed: int):
    """An IndexIVFFlat over ``vectors`` (n, d) float32 (ids 0..n-1), or a flat index when n
    is small; k-means on at most TRAIN_ROWS_PER_LIST points per list, seeded."""
    n, d = vectors.shape
    if n <= FLAT_MAX_ROWS:
        index = faiss.IndexFlatL2(d)
        index.add(vectors)
        return index
    # FAISS wants at least 39 training points per centroid
    nlist = max(1, min(int(LISTS_PER_SQRT * math.sqrt(n)), n // 39))
    index = faiss.index_factory(d, f"IVF{nlist},Flat", faiss.METRIC_L2)  # owns its quantizer
    index.cp.seed = seed
    index.cp.niter = 10
    n_train = min(n, TRAIN_ROWS_PER_LIST * nlist)
    if n_train < n:
        vectors_seen = vectors[np.random.default_rng(seed).choice(n, n_train, replace=False)]
    else:
        vectors_seen = vectors
    index.train(np.ascontiguousarray(vectors_seen))
    index.add(vectors)
    return index


def _search(index, queries: np.ndarray, k: int, nprobe: int, selector=None) -> np.ndarray:
    """(n, k) ids of the k nearest (-1 where fewer are found)."""
    if k <= 0 or len(queries) == 0:
        return np.full((len(queries), max(k, 0)), -1, dtype=np.int64)
    if isinstance(index, faiss.IndexIVF):
        params = faiss.SearchParametersIVF(nprobe=min(nprobe, index.nlist), sel=selector)
        _, ids = index.search(queries, k, params=params)
    elif selector is not None:
        _, ids = index.search(queries, k, params=faiss.SearchParameters(sel=selector))
    else:
        _, ids = index.search(queries, k)
    return ids


@dataclass
class CandidateSearch:
    """Where candidate sets come from: ``kind`` "exact" or "ivf" (or "auto": ivf from
    APPROX_MIN_SAMPLES points on the CPU); ``nprobe`` of the IVF searches, raised by
    ``tune`` when a refresh's sets held too little of the exact sets' mass."""

    kind: str = "auto"
    nprobe: int = DEFAULT_NPROBE
    seed: int = 0  # of the IVF's k-means: the same cells on every run

    def approximate(self, z: torch.Tensor) -> bool:
        if self.kind == "exact":
            return False
        if self.kind == "ivf":
            return True
        return z.device.type == "cpu" and z.shape[0] >= APPROX_MIN_SAMPLES

    def find(self, z: torch.Tensor, labels: torch.Tensor, k: int, rows=None) -> torch.Tensor:
        """(N, 2K) or, with ``rows`` (B,), (B, 2K) candidate indices: K same-class, then K
        other-class, nearest first, -1 padding (the layout of ``nearest_candidates``)."""
        if not self.approximate(z):
            return nearest_candidates(z, labels, k, rows=rows)
        return ivf_candidates(z, labels, k, self.nprobe, self.seed, rows=rows)

    def tune(self, mass_ratio: float) -> None:
        """Double nprobe (up to MAX_NPROBE) when the measured ratio fell short (the ratios
        reach ``stages_`` through ``CandidateWatch.search_mass_ratios``)."""
        if mass_ratio < MIN_MASS_RATIO:
            self.nprobe = min(MAX_NPROBE, self.nprobe * 2)


@torch.no_grad()
def ivf_candidates(
    z: torch.Tensor, labels: torch.Tensor, k: int, nprobe: int, seed: int, rows=None
) -> torch.Tensor:
    """``nearest_candidates`` by IVF search (see the module docstring): z (N, d) on the CPU,
    labels (N,) -> (N or B, 2K) int64."""
    n = z.shape[0]
    k = min(k, n - 1)
    labels_np = labels.cpu().numpy()
    order = np.argsort(labels_np, kind="stable")  # class-sorted position -> point
    zs = np.ascontiguousarray(z.detach().cpu().numpy()[order], dtype=np.float32)  # (N, d)
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    asked = np.arange(n) if rows is None else rows.cpu().numpy()  # (B,) points, answer order
    slot = np.full(n, -1, dtype=np.int64)  # sorted position -> row of the answer
    slot[position[asked]] = np.arange(len(asked))
    out = np.full((len(asked), 2 * k), -1, dtype=np.int64)  # sorted positions, (B, 2K)
    everything = _ivf(zs, seed)
    for s, e in class_runs(torch.as_tensor(labels_np[order])):
        queries = np.flatnonzero(slot[s:e] >= 0) + s  # sorted positions in this class
        if len(queries) == 0:
            continue
        answer = slot[queries]
        k_same, k_other = min(k, e - s - 1), min(k, n - (e - s))
        if k_same > 0:
            own = _ivf(zs[s:e], seed)  # ids within the class: sorted position - s
            found = _search(own, zs[queries], k_same + 1, nprobe)
            found = _drop_self(found, queries - s, k_same)
            out[answer, :k_same] = np.where(found >= 0, found + s, -1)
        if k_other > 0:
            inside = faiss.IDSelectorRange(s, e)
            outside = faiss.IDSelectorNot(inside)
            found = _search(everything, zs[queries], k_other, nprobe, outside)
            out[answer, k : k + k_other] = found
    picked = np.where(out >= 0, order[np.clip(out, 0, n - 1)], -1)  # sorted positions -> points
    return torch.as_tensor(picked, device=z.device)


def _drop_self(found: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """found (B, k + 1) ids, own (B,) each query's id: the first k ids other than its own."""
    keep = found != own[:, None]
    # a row that did not find itself keeps its first k; one that did keeps the other k
    ranks = np.cumsum(keep, axis=1)
    out = np.full((len(found), k), -1, dtype=np.int64)
    rows, cols = np.nonzero(keep & (ranks <= k))
    out[rows, ranks[rows, cols] - 1] = found[rows, cols]
    return out


def held_mass(log_p: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """sum_{j in C_i} p_ij for each row: log_p (B, N) log neighbour probabilities, candidates
    (B, M) with -1 padding -> (B,)."""
    picked = log_p.gather(1, candidates.clamp_min(0)).masked_fill(candidates < 0, float("-inf"))
    return torch.exp(torch.logsumexp(picked, dim=1))


# ------------------------------------------------------------------ keeping them honest


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
        problem,  # the stage's training.optim.problem.Problem (which imports this module)
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
        fraction of points whose set changed. The baseline of the drift rule is the mass the
        installed sets hold, measured: an approximate search's sets hold less than the exact
        sets K is chosen on, and a baseline taken from those would call every next iteration
        a fall (a search at 90% of the exact mass, below 1 - refresh_tol, would refresh
        after every iteration)."""
        k = None  # K for the new sets (None: as it is)
        if self.target_mass is not None:
            masses = self.problem.fresh_inside_mass(theta, self.rows, self.ladder)
            chosen = next(
                (i for i, m in enumerate(masses) if m >= self.target_mass), len(masses) - 1
            )
            k = self.ladder[chosen]
        refreshed = self.problem.refresh_candidates(theta, n_candidates=k)
        self.sizes.append(self.problem.n_candidates)
        self.changes.append(refreshed.changed)
        self.replaced.append(refreshed.replaced)
        self.search_mass_ratios.append(refreshed.search_mass_ratio)
        self.since = 0
        self.n_refreshes += 1
        if self.refresh_tol is not None:
            self.baseline = 1.0 - self.problem.outside_mass(theta, self.rows)
        return refreshed.changed

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
