"""Objectives: per-point scores from a block of neighbour distances.

Every objective implements one method,

    point_scores(neg_sq_dist, neighbour_labels, own_labels, valid) -> scores (B,)

where, for B query points i and M candidate neighbours j of each,

    neg_sq_dist[i, j]      = -||A x_i - A x_j||^2      (B, M) float
    neighbour_labels[i, j] = y_j                       (B, M) int (any value where not valid)
    own_labels[i]          = y_i                       (B,) int
    valid[i, j]            = j is a real neighbour of i (B, M) bool (False for i and padding)

and the training objective (maximised) is the sum of the scores over all points.
Masked entries are excluded with ``masked_fill(-inf)`` before any log-sum-exp, never by
adding a large number that is later subtracted.

NCA (Goldberger et al. 2004), with p_ij = softmax_{j valid}(-||A x_i - A x_j||^2), p_ii = 0:

    p_i = sum_{j in C_i} p_ij                                    (eq 2)
    f(A) = sum_i p_i                                             (eq 3)   objective "nca"
    g(A) = sum_i log p_i                                         (eq 6)   objective "nca-log"

computed in log space: log p_i = logsumexp_{j valid, same}(-d_ij) - logsumexp_{j valid}(-d_ij).
A point with no valid same-class neighbour has p_i = 0 whatever A is; it scores 0 in f and is
left out of g (its log p_i = -inf would not depend on A).
"""

from __future__ import annotations

import torch

from training.numerics import NEG_INF


class Objective:
    """Interface: a sum over points of ``point_scores``; larger is better."""

    name: str = "objective"
    #: True when the score is a log-probability (then the sum is a log-likelihood)
    log_form: bool = False
    #: the k of the kNN classifier this objective trains for
    k: int = 1

    def point_scores(
        self,
        neg_sq_dist: torch.Tensor,
        neighbour_labels: torch.Tensor,
        own_labels: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def floats_per_pair(self, n_neighbours: int) -> int:
        """Working float32 values per (point, neighbour) pair in point_scores with M =
        n_neighbours neighbours a row (per-row work spread over its M pairs): sizes the chunks
        (``training.numerics.chunk_rows``). NCA's log-sum-exps hold about 10 (B, M)
        temporaries."""
        return 10


def log_prob_correct(
    neg_sq_dist: torch.Tensor, same_class: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p_i for each row, and whether row i has any valid same-class neighbour.

    neg_sq_dist, same_class, valid: (B, M)  ->  (log_p (B,), has_same (B,) bool).
    Rows without a same-class neighbour get log_p = 0 (a finite placeholder: callers mask it).
    """
    logits = neg_sq_dist.masked_fill(~valid, NEG_INF)
    log_den = torch.logsumexp(logits, dim=1)  # (B,)
    same_valid = same_class & valid
    has_same = same_valid.any(dim=1)  # (B,)
    # Rows with no same-class neighbour: compute on a harmless dummy row to keep grads finite.
    num_logits = logits.masked_fill(~same_valid, NEG_INF)
    num_logits = torch.where(has_same[:, None], num_logits, torch.zeros_like(num_logits))
    log_num = torch.logsumexp(num_logits, dim=1)
    log_p = torch.where(has_same, log_num - log_den, torch.zeros_like(log_den))
    return log_p, has_same


class NCAObjective(Objective):
    """f(A) = sum_i p_i (eq 3), or g(A) = sum_i log p_i (eq 6) when ``log_form``."""

    def __init__(self, log_form: bool = False):
        self.log_form = log_form
        self.name = "nca-log" if log_form else "nca"
        self.k = 1

    def point_scores(self, neg_sq_dist, neighbour_labels, own_labels, valid):
        same_class = neighbour_labels == own_labels[:, None]
        log_p, has_same = log_prob_correct(neg_sq_dist, same_class, valid)
        if self.log_form:
            return torch.where(has_same, log_p, torch.zeros_like(log_p))
        return torch.where(has_same, torch.exp(log_p), torch.zeros_like(log_p))

    def __repr__(self) -> str:
        return f"NCAObjective(log_form={self.log_form})"
