"""kNCA (Tarlow et al. 2013): the exact expected accuracy of a kNN classifier with k > 1.

For a point i with candidate neighbours j (weights w_j = exp(-(d_ij - min_j d_ij))), a set s
of k neighbours is drawn with probability prod_{j in s} w_j / Z, Z = e_k(w), where e_m(v) is
the elementary symmetric polynomial of degree m: the coefficient of t^m in prod_j (1 + v_j t).
With w_c the weights of the candidates of class c and y = y_i:

    all:       P_i = e_k(w_y) / Z                        (every neighbour has i's class)
    majority:  P_i = (1/Z) sum_{m=1..k} e_m(w_y) [t^(k-m)] prod_{c != y} (sum_{r<m} e_r(w_c) t^r)
               (i's class gets strictly more votes than every other class)

Objectives: sum_i P_i, or sum_i log P_i (the "-log" forms). With k = 1 both equal NCA's p_i.

Computation, all in log space (every coefficient is a sum of positive terms, so there is no
cancellation; nothing overflows or underflows in float32):

* :func:`class_polynomials` builds every class's E_c(t) = prod_{j in c} (1 + w_j t), truncated
  at degree k, in one pass over the candidates: candidate j multiplies only its own class's
  polynomial, so the work is O(M k) a row, batched over the rows. "all" needs two classes
  (i's own, every other); "majority" all C. Power sums with Newton's identities are not
  used: they cancel catastrophically.
* :func:`log_prob_majority` multiplies the other classes' polynomials (:func:`log_poly_mul`),
  sharing one untruncated product between every m > k / 2.
* The fast path (``linear_log_prob``, both variants): where a row's weights keep every
  coefficient within float64's range (``in_linear_range``, nearly every row of a trained
  model), the same programme runs on the coefficients themselves in float64: multiplications
  and additions instead of log-add-exps, and products of polynomials as one matrix product.
  Rows outside the range, or whose P_i is below exp(-600), take the log programme. Both give
  P_i to float64's precision (``tests/training/objectives/test_knca.py``). On the CPU the
  fast path runs in C (:mod:`training.objectives.knca_native`: the same programme a row at a
  time, with its reverse mode written out); ``NCA_KNN_NATIVE=0``, CUDA or a missing compiler
  keep it in torch.
* Gradients of the torch programmes flow through by autograd. Inside the programme "log 0"
  is the finite LOG_ZERO = -1e30 rather than -inf, so torch's fused logsumexp needs no
  special cases and gradients stay finite; results below LOG_ZERO / 10 are mapped back to
  -inf at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from training.numerics import LOG_ZERO, NEG_INF, floored_logsumexp
from training.objectives import knca_native
from training.objectives.nca import Objective

_ANTI_DIAGONALS: dict[tuple[int, int, int, str], torch.Tensor] = {}


def _anti_diagonal_index(la: int, lb: int, lout: int, device) -> torch.Tensor:
    """(lout, min(la, lout)) indices into a flattened (la x lb) pair matrix plus one pad slot:
    row m lists the pairs (r, m - r) for r = 0.., with the pad index (la * lb) where r > m or
    m - r >= lb."""
    key = (la, lb, lout, str(device))
    if key not in _ANTI_DIAGONALS:
        m = torch.arange(lout)[:, None]
        r = torch.arange(min(la, lout))[None, :]
        s = m - r
        ok = (s >= 0) & (s < lb)
        _ANTI_DIAGONALS[key] = torch.where(ok, r * lb + s.clamp(0, lb - 1), la * lb).to(device)
    return _ANTI_DIAGONALS[key]


def log_poly_mul(a: torch.Tensor, b: torch.Tensor, max_degree: int | None = None) -> torch.Tensor:
    """Product of polynomials given by log coefficients, truncated at ``max_degree``.

    a: (..., la), b: (..., lb) with a[..., r] = log [t^r] A(t)  ->  (..., lout), log [t^m] (AB)(t)
    for m < lout = min(la + lb - 1, max_degree + 1) (default: max_degree = la - 1).
    [t^m] AB = sum_r a_r b_{m-r}: one gather lays each anti-diagonal of a_r + b_s out as a row,
    then one log-sum-exp per row (each with its own maximum: no underflow).
    """
    la, lb = a.shape[-1], b.shape[-1]
    max_degree = la - 1 if max_degree is None else max_degree
    lout = min(la + lb - 1, max_degree + 1)
    pair = (a.unsqueeze(-1) + b.unsqueeze(-2)).flatten(-2)  # (..., la * lb)
    pad = torch.full((*pair.shape[:-1], 1), LOG_ZERO, dtype=pair.dtype, device=pair.device)
    pair = torch.cat([pair, pad], dim=-1)
    rows = pair[..., _anti_diagonal_index(la, lb, lout, pair.device)]  # (..., lout, terms)
    return floored_logsumexp(rows, -1).clamp_min(LOG_ZERO)


def _restore_neg_inf(log_values: torch.Tensor) -> torch.Tensor:
    return log_values.masked_fill(log_values < LOG_ZERO / 10, NEG_INF)


RECURRENCE_BLOCK = 64  # candidates per block of the sequential recurrence


_PRODUCT_MATRICES: dict[tuple[int, int, int, str, torch.dtype], torch.Tensor] = {}


def poly_mul(a: torch.Tensor, b: torch.Tensor, max_degree: int | None = None) -> torch.Tensor:
    """Product of polynomials given by their coefficients, truncated at ``max_degree``:
    a: (..., la), b: (..., lb) -> (..., lout) as in :func:`log_poly_mul`. The outer product's
    anti-diagonals are summed by one matrix product with a 0/1 matrix ((la lb), lout)."""
    la, lb = a.shape[-1], b.shape[-1]
    max_degree = la - 1 if max_degree is None else max_degree
    lout = min(la + lb - 1, max_degree + 1)
    key = (la, lb, lout, str(a.device), a.dtype)
    if key not in _PRODUCT_MATRICES:
        r, s = torch.meshgrid(torch.arange(la), torch.arange(lb), indexing="ij")
        degree = (r + s).flatten()  # (la lb,)
        sums = degree[:, None] == torch.arange(lout)[None, :]
        _PRODUCT_MATRICES[key] = sums.to(device=a.device, dtype=a.dtype)
    return (a.unsqueeze(-1) * b.unsqueeze(-2)).flatten(-2) @ _PRODUCT_MATRICES[key]


class Algebra(NamedTuple):
    """How the polynomial programme represents a coefficient: its log (any magnitude, the
    general case) or the coefficient itself in float64 (fast; rows in range only)."""

    zero: float  # the coefficient 0
    unit: float  # the coefficient 1
    times: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a b
    plus: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a + b
    total: Callable[[torch.Tensor, int], torch.Tensor]  # sum along a dim
    poly_mul: Callable[..., torch.Tensor]  # truncated product of coefficient vectors


LOG = Algebra(LOG_ZERO, 0.0, torch.add, torch.logaddexp, floored_logsumexp, log_poly_mul)
LINEAR = Algebra(0.0, 1.0, torch.mul, torch.add, lambda x, dim: x.sum(dim), poly_mul)


def unit_poly(shape: tuple[int, ...], k: int, like: torch.Tensor, algebra: Algebra) -> torch.Tensor:
    """The polynomial 1 in ``algebra``: shape (*shape, k+1)."""
    poly = torch.full((*shape, k + 1), algebra.zero, dtype=like.dtype, device=like.device)
    poly[..., 0] = algebra.unit
    return poly


def class_polynomials(
    log_w: torch.Tensor, labels: torch.Tensor, n_classes: int, k: int
) -> torch.Tensor:
    """log e_r(w_c) for every class c: (B, M) log weights, (B, M) labels -> (B, C, k+1).

    Candidate j multiplies only its own class's polynomial by (1 + w_j t), i.e. the
    recurrence e_r <- e_r + w_j e_{r-1} (r = k..1), in log space (log-add-exp of two
    non-negative terms: no cancellation), so the work is O(M k) a row rather than the
    O(C M k) of running every class's polynomial over all M masked candidates. The M
    candidates are cut into blocks of RECURRENCE_BLOCK that run the recurrence side by side
    (batched over rows and blocks). Within a block the candidates are ordered by class, so
    each class is one run: the recurrence carries only the current run's polynomial (reset to
    1 where a run begins), and a class's polynomial is its run's last state (1 without a
    run). The blocks' polynomials are then multiplied class by class in a balanced tree:
    RECURRENCE_BLOCK + log2(M / RECURRENCE_BLOCK) sequential steps whatever M is (M = N - 1
    in exact mode).
    """
    poly = _class_polynomials(log_w.clamp_min(LOG_ZERO), labels, n_classes, k, LOG)
    return _restore_neg_inf(poly.clamp_min(LOG_ZERO))


def _class_polynomials(
    w: torch.Tensor, labels: torch.Tensor, n_classes: int, k: int, algebra: Algebra
) -> torch.Tensor:
    """:func:`class_polynomials` in ``algebra``: w (B, M) weights as the algebra holds them."""
    b, m = w.shape
    n_blocks = -(-m // RECURRENCE_BLOCK)
    width = min(m, RECURRENCE_BLOCK)
    pad = n_blocks * width - m
    if pad:  # absent candidates: weight 0, any class
        w = torch.cat([w, w.new_full((b, pad), algebra.zero)], 1)
        labels = torch.cat([labels, labels.new_zeros((b, pad))], 1)
    w = w.view(b, n_blocks, width)
    labels = labels.reshape(b, n_blocks, width)
    # each block's candidates ordered by class, so that every class is one run: the recurrence
    # then carries one polynomial (the current run's) instead of all C
    labels, order = torch.sort(labels, dim=-1, stable=True)
    w = w.gather(-1, order)
    starts = torch.ones_like(labels, dtype=torch.bool)
    starts[..., 1:] = labels[..., 1:] != labels[..., :-1]  # (B, blocks, width): a run begins
    one = unit_poly((b, n_blocks), k, w, algebra)  # (B, blocks, k+1)
    state, states = one, []
    for j in range(width):
        state = torch.where(starts[..., j : j + 1], one, state)
        raised = algebra.plus(state[..., 1:], algebra.times(state[..., :-1], w[..., j : j + 1]))
        state = torch.cat([state[..., :1], raised], -1)
        states.append(state)
    states = torch.stack(states, 2)  # (B, blocks, width, k+1): the run's product so far
    # class c's polynomial in a block is its run's last state; identity where it has no run
    classes = torch.arange(n_classes, device=labels.device)
    ends = (labels.unsqueeze(-1) <= classes).sum(2) - 1  # (B, blocks, C): last position <= c
    present = (labels.unsqueeze(-1) == classes).any(2)  # (B, blocks, C)
    index = ends.clamp_min(0).unsqueeze(-1).expand(b, n_blocks, n_classes, k + 1)
    poly = torch.where(present.unsqueeze(-1), states.gather(2, index), one.unsqueeze(2))
    # (B, blocks, C, k+1)
    while poly.shape[1] > 1:  # multiply the blocks' polynomials, class by class
        if poly.shape[1] % 2:
            poly = torch.cat([poly, unit_poly((b, 1, n_classes), k, poly, algebra)], 1)
        poly = algebra.poly_mul(poly[:, 0::2], poly[:, 1::2], max_degree=k)
    return poly.squeeze(1)


def present_classes(
    labels: torch.Tensor, own: torch.Tensor, valid: torch.Tensor, n_classes: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Renumber each row's classes to those present among its candidates and itself.

    labels: (B, M) candidate classes, own: (B,), valid: (B, M)  ->  labels (B, M) and own (B,)
    in 0..C'-1 (order kept), and C', the largest number of classes present in a row. A class
    with no candidate in a row has E_c(t) = 1 there, which changes no product: dropping it
    leaves every P_i exact and saves its share of the recurrence and of the C - 1 products.
    Padding (invalid) candidates, weight 0, get class 0.
    """
    rows = torch.arange(labels.shape[0], device=labels.device)
    present = torch.zeros(labels.shape[0], n_classes, dtype=torch.bool, device=labels.device)
    present.scatter_(1, torch.where(valid, labels, own[:, None]), True)
    present[rows, own] = True
    rank = present.long().cumsum(1) - 1  # (B, C): the class's new number where present
    compact = torch.where(valid, rank.gather(1, labels.clamp_min(0)), 0)
    return compact, rank[rows, own], int(present.sum(1).max())


def log_prob_majority(log_e: torch.Tensor, own: torch.Tensor, k: int) -> torch.Tensor:
    """log P_i for the "majority" variant (strict plurality of i's class).

    log_e: (B, C, k+1) log e_r(w_c); own: (B,) i's class  ->  (B,).

    With Q(t) = prod_{c != y} E_c(t) and T_m the same product with every factor truncated
    below degree m,

        Z = [t^k] E_y(t) Q(t),    P_i Z = sum_{m=1..k} e_m(w_y) [t^(k-m)] T_m(t).

    [t^(k-m)] T_m only involves factor degrees r <= k - m, so where k - m < m the
    truncation removes nothing and [t^(k-m)] T_m = [t^(k-m)] Q: only m = 2..floor(k/2)
    need products of their own (m = 1 contributes nothing for k > 1: every other class is
    truncated to the constant 1, whose coefficient of t^(k-1) is 0), each truncated at
    degree k - m.
    """
    log_num, log_z = _majority_terms(log_e.clamp_min(LOG_ZERO), own, k, LOG)
    return _restore_neg_inf(log_num.clamp_min(LOG_ZERO) - log_z)


def _majority_terms(
    e: torch.Tensor, own: torch.Tensor, k: int, algebra: Algebra
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P_i Z, Z) of :func:`log_prob_majority` in ``algebra``: e (B, C, k+1) -> (B,), (B,)."""
    b, n_classes, _ = e.shape
    rows = torch.arange(b, device=e.device)
    own_e = e[rows, own]  # (B, k+1)
    is_own = torch.zeros(b, n_classes, 1, dtype=torch.bool, device=e.device)
    is_own[rows, own] = True
    others = torch.where(is_own, unit_poly((), k, e, algebra), e)  # (B, C, k+1)

    def product(max_degree: int, width: int) -> torch.Tensor:
        """prod_c of the others' polynomials cut to degrees < width, up to max_degree."""
        out = others[:, 0, :width]
        for c in range(1, n_classes):  # C - 1 products; classes are few
            out = algebra.poly_mul(out, others[:, c, :width], max_degree=max_degree)
        return out

    q = product(k, k + 1)  # (B, k+1)
    z = algebra.total(algebra.times(own_e, q.flip(-1)), -1)  # sum_r e_r(w_y) Q_{k-r}
    terms = []
    for m in range(1, k + 1):
        if k - m < m:
            coefficient = q[:, k - m]
        elif m == 1:
            continue  # (k > 1) the constant 1 has no t^(k-1) term
        else:
            t_m = product(k - m, m)  # degree at most (C - 1)(m - 1): maybe below k - m
            coefficient = (
                t_m[:, k - m] if t_m.shape[1] > k - m else torch.full_like(q[:, 0], algebra.zero)
            )
        terms.append(algebra.times(own_e[:, m], coefficient))
    return algebra.total(torch.stack(terms, -1), -1), z


def _all_terms(e: torch.Tensor, k: int, algebra: Algebra) -> tuple[torch.Tensor, torch.Tensor]:
    """(P_i Z, Z) of "all" in ``algebra``: e (B, 2, k+1), class 0 i's own, 1 every other ->
    e_k(w_y) and Z = [t^k] E_0 E_1 = sum_r e_r(w_y) e_(k-r)(w_other), each (B,)."""
    return e[:, 0, k], algebra.total(algebra.times(e[:, 0], e[:, 1].flip(-1)), -1)


def log_prob_all(log_e: torch.Tensor, k: int) -> torch.Tensor:
    """log P_i for the "all" variant: log_e (B, 2, k+1) as in :func:`_all_terms` -> (B,)."""
    log_num, log_z = _all_terms(log_e.clamp_min(LOG_ZERO), k, LOG)
    return _restore_neg_inf(log_num - log_z)


# The fast path: coefficients themselves in float64 (no log-add-exp), for rows whose weights
# keep every coefficient in float64's range. With the logits shifted by the mean of the row's
# k largest (the product of the k largest weights is 1, so Z = e_k(w) >= 1), a coefficient of
# degree r <= k is at most C(M, r) times the product of the r largest weights, exp(S_r) with
# S_r the partial sum of the k largest shifted logits; a row qualifies when
# max_r S_r + k log M < LINEAR_LOG_RANGE. Terms that underflow are below 1e-300 of Z, far
# below float64's resolution; P_i below exp(LINEAR_LOG_FLOOR) goes to the log programme, so
# log P_i keeps its digits for any distance.
LINEAR_LOG_RANGE = 600.0
LINEAR_LOG_FLOOR = -600.0


def in_linear_range(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits (B, M) (-inf where absent) that the float64 programme can hold: at
    least k candidates and max_r S_r + k log M below LINEAR_LOG_RANGE. Returns (in range (B,)
    bool, shift (B, 1) float64: the mean of each row's k largest logits)."""
    b, m = logits.shape
    if m < k:
        none = torch.zeros(b, dtype=torch.bool, device=logits.device)
        return none, torch.zeros(b, 1, dtype=torch.float64, device=logits.device)
    top = logits.detach().double().topk(k, dim=1).values  # (B, k) descending
    shift = top.mean(1, keepdim=True)
    partial = (top - shift).cumsum(1)  # (B, k): S_1 .. S_k
    bound = partial.amax(1) + k * torch.log(torch.tensor(float(m), dtype=torch.float64))
    return torch.isfinite(top).all(1) & (bound < LINEAR_LOG_RANGE), shift


def linear_log_prob(
    logits: torch.Tensor,
    shift: torch.Tensor,
    labels: torch.Tensor,
    own: torch.Tensor,
    n_classes: int,
    k: int,
    variant: str = "majority",
    native: bool | None = None,
) -> torch.Tensor:
    """log P_i of ``variant`` for rows :func:`in_linear_range` accepts, computed with the
    coefficients themselves in float64: logits (B, M), shift (B, 1) from in_linear_range,
    labels (B, M) and own (B,) in 0..n_classes-1 -> (B,) float64. For "all", labels are 0
    (i's class) and 1 (any other) and n_classes is 2.

    native: the C programme of :mod:`training.objectives.knca_native` (True), the torch one
    (False), or the C one where it can run (None)."""
    if native is None:
        native = knca_native.usable(logits)
    if native:
        return NativeLinearLogProb.apply(logits, shift, labels, own, n_classes, k, variant)
    w = torch.exp(logits.double() - shift)  # (B, M); absent: exp(-inf) = 0
    e = _class_polynomials(w, labels, n_classes, k, LINEAR)  # (B, C, k+1)
    if variant == "all":
        num, z = _all_terms(e, k, LINEAR)
    else:
        num, z = _majority_terms(e, own, k, LINEAR)
    # num = 0 (own class absent, or underflow) would send inf * 0 = NaN back through log even
    # where the caller replaces the row; clamped, such rows read as below LINEAR_LOG_FLOOR
    return torch.log(num.clamp_min(1e-300)) - torch.log(z)


class NativeLinearLogProb(torch.autograd.Function):
    """:func:`linear_log_prob` by the C programme: forward returns log P_i (B,) float64 and
    keeps J = d log P_i / d logit_ij (B, M), which the same pass computes; backward is
    grad_out[:, None] J (a row's P_i depends on its own logits only)."""

    @staticmethod
    def forward(ctx, logits, shift, labels, own, n_classes, k, variant):
        log_p, jac = knca_native.log_prob_and_jacobian(
            logits, shift, labels, own, n_classes, k, variant
        )
        ctx.save_for_backward(jac)
        ctx.dtype = logits.dtype
        return log_p

    @staticmethod
    def backward(ctx, grad_out):
        (jac,) = ctx.saved_tensors
        # Rows the caller does not use get grad_out = 0 exactly: those whose P_i fell below
        # exp(LINEAR_LOG_FLOOR) and went to the log programme. Their J may hold inf or NaN
        # (1 / num times coefficients near exp(600) overflows), and 0 * NaN = NaN would
        # poison the gradient of every point they touch; they contribute nothing instead.
        used = grad_out[:, None] != 0
        grad = torch.where(used, grad_out[:, None] * jac, torch.zeros_like(jac))
        return grad.to(ctx.dtype), None, None, None, None, None, None


class KNCAObjective(Objective):
    """Expected kNN accuracy, "majority" or "all" variant, optionally in log form.

    ``n_classes`` (set by the estimator) sizes the batched per-class polynomials.
    """

    def __init__(self, variant: str, k: int, log_form: bool, n_classes: int | None = None):
        if variant not in ("majority", "all"):
            raise ValueError(f"variant must be 'majority' or 'all', got {variant!r}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.variant = variant
        self.k = k
        self.log_form = log_form
        self.n_classes = n_classes
        self.name = f"knca-{variant}" + ("-log" if log_form else "")

    def log_probabilities(
        self,
        neg_sq_dist: torch.Tensor,
        neighbour_labels: torch.Tensor,
        own: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """log P_i: neg_sq_dist (B, M), neighbour_labels (B, M), own (B,), valid (B, M).
        -inf where a row has fewer than k valid candidates (no k-subset to draw)."""
        too_few = valid.sum(1) < self.k  # (B,)
        return self._log_probabilities(neg_sq_dist, neighbour_labels, own, valid).masked_fill(
            too_few, NEG_INF
        )

    def _log_probabilities(self, neg_sq_dist, neighbour_labels, own, valid) -> torch.Tensor:
        logits = neg_sq_dist.masked_fill(~valid, NEG_INF)
        # -min_j d_ij, so w_j = exp(-(d_ij - min d)) <= 1. P_i does not depend on the shift, so
        # it is detached: its exact-zero gradient would otherwise arrive as float32 rounding noise
        shift = logits.detach().amax(dim=1, keepdim=True)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        log_w = logits - shift
        if self.variant == "all":
            # two "classes" are enough: i's own (0) and every other (1)
            labels = (neighbour_labels != own[:, None]).long()
            own_c, n_present = torch.zeros_like(own), 2
        else:
            n_classes = self.n_classes or int(max(neighbour_labels.max(), own.max())) + 1
            labels, own_c, n_present = present_classes(neighbour_labels, own, valid, n_classes)
        linear, linear_shift = in_linear_range(logits, self.k)  # (B,): the fast path's rows
        log_p = torch.zeros_like(logits[:, 0])  # (B,)
        if linear.any():
            rows = torch.nonzero(linear).squeeze(1)
            fast = linear_log_prob(
                logits[rows],
                linear_shift[rows],
                labels[rows],
                own_c[rows],
                n_present,
                self.k,
                self.variant,
            )
            underflow = fast < LINEAR_LOG_FLOOR  # tiny P_i: the log programme resolves them
            log_p = log_p.index_put((rows,), fast.to(log_p.dtype))
            linear[rows[underflow]] = False
        if not linear.all():
            rows = torch.nonzero(~linear).squeeze(1)
            log_e = class_polynomials(log_w[rows], labels[rows], n_present, self.k)
            if self.variant == "all":
                slow = log_prob_all(log_e, self.k)
            else:
                slow = log_prob_majority(log_e, own_c[rows], self.k)
            log_p = log_p.index_put((rows,), slow)
        return log_p

    def floats_per_pair(self, n_neighbours: int) -> int:
        """Working float32-sized values per (row, candidate) pair of one evaluation with its
        backward, M = n_neighbours candidates a row.

        Per pair: the recurrence keeps one polynomial's (k+1) coefficients per candidate for
        autograd (the current class run's; float64 on the fast path, so twice the bytes),
        about C (k+1) with the gathers and the backward, plus ~96 for the logits, weights,
        labels and masks. Per row: the C class polynomials and the products of the majority
        terms, (k+1)^2 pairs each, about 10 C (k+1)^2, spread over the row's M pairs.
        C = n_classes for "majority", 2 for "all".

        The estimate is an upper bound: the peak RSS of a forward and backward pass on random
        data (C = 10, k = 5 and 10, M = 16 to 255) stays below it.
        """
        n_classes = (self.n_classes or 10) if self.variant == "majority" else 2
        per_row = 10 * n_classes * (self.k + 1) ** 2
        return n_classes * (self.k + 1) + 96 + -(-per_row // max(1, n_neighbours))

    def point_scores(self, neg_sq_dist, neighbour_labels, own_labels, valid) -> torch.Tensor:
        log_p = self.log_probabilities(neg_sq_dist, neighbour_labels, own_labels, valid)
        # a point with fewer than k neighbours, or whose event is impossible, scores 0 / is left out
        possible = torch.isfinite(log_p)
        safe = torch.where(possible, log_p, torch.zeros_like(log_p))
        if self.log_form:
            return torch.where(possible, safe, torch.zeros_like(safe))
        return torch.where(possible, torch.exp(safe), torch.zeros_like(safe))

    def __repr__(self) -> str:
        return f"KNCAObjective(variant={self.variant!r}, k={self.k}, log_form={self.log_form})"
