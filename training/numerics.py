"""Numerics shared by the objectives, the kernels that evaluate them and the preparation.

Nothing here knows about a particular objective or stage; any module of ``training`` may
import it (the objectives, ``optim.problem`` and ``optim.candidates``, the model's
preparation, initialisation and fit loop, ``distributed.sharded_stats``, the learned
references, the baselines, the job), and it imports none of them: the import graph of
``training`` has no cycles. What it holds:

* the floors that keep exp() and log 0 finite (``EXP_FLOOR``, ``LOG_ZERO``),
* ``floored_logsumexp``,
* ``class_runs`` (points sorted by class, one contiguous run per class),
* ``chunk_rows`` (rows per chunk from a memory budget),
* ``evenly_spaced_rows`` (a deterministic sample of rows, spread however they are ordered),
* ``shard_bounds`` (rank r of P's contiguous rows [start, stop) of N: the data split and the
  data-parallel fit cut rows the same way),
* ``zero_subnormal`` (float32 probabilities too small to count, set to 0 before a product
  that a subnormal operand would slow 100x on some CPUs),
* ``fisher_directions``, ``fisher_directions_of_rows``, ``principal_axes`` and
  ``orthonormal_complement`` (the linear algebra of the LDA and PCA initial maps),
* ``PrecomputedGradient``, the autograd backward both evaluation paths share: the forward
  pass computes the objective and its gradient with respect to Z together (the exact NCA
  kernel computes the value alone when Z does not require grad), and backward only scales
  that gradient.
"""

from __future__ import annotations

import itertools

import numpy as np
import scipy.linalg
import torch

NEG_INF = float("-inf")
# log 0 inside the kNCA programme: exp() of it is 0 and sums of a few stay finite, so torch's
# fused logsumexp needs no special case for -inf and gradients stay finite
LOG_ZERO = -1e30
# exponents more than 80 below a row's maximum are floored here before exp(): exp(-80) ~ 2e-35
# is below float32 resolution of any sum that holds the maximum (1), so no value changes,
# while exp never takes its slow subnormal path
# (benchmarks/README.md, "Training: ours vs scikit-learn")
EXP_FLOOR = -80.0

DEFAULT_MEMORY_BUDGET = 256 * 2**20  # bytes for one chunk's (B, M) temporaries
MAX_CHUNK_ROWS = 8192
FLOAT32_BYTES = 4


def floored_logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """log sum_j exp(x_j) along ``dim``, each exponent x_j - max floored at EXP_FLOOR.

    The maximum is detached: the gradient exp(x_j - m) / sum is exact without it, and it is
    clamped at LOG_ZERO so that a row of log 0 gives LOG_ZERO + log n, finite.
    """
    m = x.detach().amax(dim=dim, keepdim=True).clamp_min(LOG_ZERO)
    total = torch.exp((x - m).clamp_min(EXP_FLOOR)).sum(dim=dim, keepdim=True)
    return (m + torch.log(total)).squeeze(dim)


def class_runs(sorted_labels: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal labels in a sorted label vector (N,)."""
    n = sorted_labels.shape[0]
    change = torch.nonzero(sorted_labels[1:] != sorted_labels[:-1]).flatten() + 1
    return list(itertools.pairwise([0, *change.tolist(), n]))


def chunk_rows(
    n_neighbours: int, floats_per_pair: int = 10, budget_bytes: int = DEFAULT_MEMORY_BUDGET
) -> int:
    """Rows B per chunk so that a chunk's working memory, B x n_neighbours pairs of
    ``floats_per_pair`` float32 values each, stays within ``budget_bytes``; 1 <= B <= 8192."""
    per_row = FLOAT32_BYTES * max(1, floats_per_pair) * max(1, n_neighbours)
    return int(max(1, min(MAX_CHUNK_ROWS, budget_bytes // per_row)))


class PrecomputedGradient(torch.autograd.Function):
    """Base of autograd functions whose forward(ctx, z, *non-differentiable arguments) returns a
    scalar value and saves its gradient d value / dz (N, d) with ``ctx.save_for_backward``
    (a forward whose z does not require grad may save nothing: no backward reaches it);
    backward scales the saved gradient by the incoming one. Z = X A^T then carries it to A."""

    @staticmethod
    def backward(ctx, grad_output):
        (grad_z,) = ctx.saved_tensors
        return grad_output * grad_z, *([None] * (len(ctx.needs_input_grad) - 1))


def evenly_spaced_rows(n: int, count: int) -> np.ndarray:
    """(min(count, n),) sorted row indices spread evenly over 0..n-1, both ends included:
    deterministic, the same on every rank, and spread over the classes however the rows are
    ordered by class."""
    return np.unique(np.linspace(0, n - 1, min(count, n)).astype(np.int64))


def fisher_directions(
    between: np.ndarray, within: np.ndarray, n: int, n_components: int, n_features=None
) -> np.ndarray:
    """Fisher's discriminant directions (n_components, D): the top generalised eigenvectors
    of S_b v = lambda S_w v for the between- and within-class scatter matrices (D, D) of n
    rows, scaled so that the within-class covariance S_w / n is the identity along them.
    S_w gets a ridge of 1e-6 of its mean eigenvalue over ``n_features`` dimensions (D when
    None; the full D when the matrices are those of a span, ``fisher_directions_of_rows``),
    so rank-deficient data (constant features, D > N) still has a solution."""
    n_features = within.shape[0] if n_features is None else n_features
    ridge = 1e-6 * max(np.trace(within) / n_features, np.finfo(np.float64).tiny)
    _, vectors = scipy.linalg.eigh(between, within + ridge * np.eye(within.shape[0]))
    return vectors[:, ::-1][:, :n_components].T * np.sqrt(n)  # v^T (S_w / n) v = 1


def principal_axes(centred: np.ndarray, n_components: int) -> np.ndarray:
    """The top ``n_components`` principal axes (n_components, D) of centred rows (N, D),
    largest variance first: eigenvectors of the scatter C^T C (D, D) from one GEMM and an
    O(D^3) eigendecomposition, or, with fewer rows than features, the right singular
    vectors of the rows, at O(N^2 D) (the same axes: C^T C = V S^2 V^T), completed past N
    by orthonormal directions outside their span (eigenvalue 0, as eigh's would be). Signs
    as either decomposition gives them."""
    n, n_features = centred.shape
    if n < n_features:
        _, _, vt = np.linalg.svd(centred, full_matrices=False)  # (N, D), largest first
        if n_components <= n:
            return vt[:n_components]
        return np.vstack([vt, orthonormal_complement(vt, n_components - n)])
    _, vectors = np.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
    return vectors[:, ::-1][:, :n_components].T


def orthonormal_complement(rows: np.ndarray, count: int) -> np.ndarray:
    """``count`` orthonormal rows (count, D) orthogonal to the orthonormal ``rows`` (r, D),
    r + count <= D: the first r + count coordinate axes projected off their span, the
    ``count`` longest residuals orthonormalised (QR with column pivoting): deterministic,
    O(D (r + count)^2)."""
    n_features = rows.shape[1]
    axes = np.eye(n_features, len(rows) + count)  # (D, r + count)
    residual = axes - rows.T @ (rows @ axes)  # (D, r + count), orthogonal to the rows
    q, _, _ = scipy.linalg.qr(residual, mode="economic", pivoting=True)
    q = q[:, :count]
    return (q - rows.T @ (rows @ q)).T  # once more off the span, against rounding


def fisher_directions_of_rows(
    X: np.ndarray, y_idx: np.ndarray, n_classes: int, n_components: int
) -> np.ndarray:
    """``fisher_directions`` (n_components, D) of rows X (N, D) with class indices y_idx
    (N,). With fewer rows than features it works in the span of the centred rows (a basis V
    (D, r) from their SVD, r <= N) at O(N^2 D), not O(D^3): S_b and S_w map into that span,
    so a direction with lambda > 0 lies in it (its part outside would need
    0 = lambda * ridge * v_perp), and V^T S_w V has S_w's trace, so the ridge is the same."""
    counts = np.bincount(y_idx, minlength=n_classes)  # (C,)
    class_means = (np.eye(n_classes)[y_idx].T @ X) / np.maximum(counts, 1)[:, None]  # (C, D)
    between = (class_means - X.mean(axis=0)) * np.sqrt(counts)[:, None]  # (C, D)
    within_rows = X - class_means[y_idx]  # (N, D)
    n, n_features = X.shape
    basis = None
    if n < n_features:
        _, singular, vt = np.linalg.svd(X - X.mean(axis=0), full_matrices=False)
        rank = int(np.count_nonzero(singular > n * np.finfo(np.float64).eps * singular[0]))
        basis = vt[:rank] if n_components <= rank else None  # (r, D)
    if basis is None:  # as many rows as features, or more directions asked than the span has
        s_b, s_w = between.T @ between, within_rows.T @ within_rows
        return fisher_directions(s_b, s_w, n, n_components)
    b, w = between @ basis.T, within_rows @ basis.T  # (C, r), (N, r)
    directions = fisher_directions(b.T @ b, w.T @ w, n, n_components, n_features=n_features)
    return directions @ basis  # (n_components, D)


# float32 probabilities below this are taken as 0 before the products they enter
# (zero_subnormal): 4 x the smallest normal over epsilon, so that what is left, scaled by a
# factor of at least epsilon / 2 (the exact kernel's |p_i - 1| / p_i, p_i a float32 sum),
# stays normal; a p_ij this small is below float32's resolution of every sum it enters of
# at least TINY_P / eps (the exact kernel's P_FLOOR keeps p_i above that)
TINY_P = 4.0 * torch.finfo(torch.float32).tiny / torch.finfo(torch.float32).eps


def zero_subnormal(p: torch.Tensor) -> torch.Tensor:
    """p (in place) with its float32 entries at or below TINY_P set to 0 (NaN kept; every
    caller passes probabilities, so nothing negative is met); other dtypes as they are
    (float64's subnormals lie below exp(-708), where the tests compare every digit with the
    exact sums).

    Exps below float32's smallest normal (1.2e-38) are subnormal, and a product over a buffer
    of them ran 100x slower on an Intel Xeon (a microcode assist per element; AMD's EPYC has
    none), which doubled the digits' finish and slowed the prototypes' learning by a third
    (``benchmarks/README.md``, "Subnormal probabilities on an Intel Xeon")."""
    if p.dtype == torch.float32:
        torch.nn.functional.threshold_(p, TINY_P, 0.0)
    return p


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's rows when N rows are cut into world_size contiguous shards
    whose sizes differ by at most one (the first N mod P shards have one more row)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
