"""Fused closed-form value and gradient of NCA's f and g in embedding space (exact mode).

For query rows i and all points j, with z = A x (N, d) and logits L_ij = -||z_i - z_j||^2
(L_ii = -inf), p_ij = softmax_j(L_ij) and p_i = sum_{j in C_i} p_ij:

    d p_i / d L_ij      = p_ij (1[j in C_i] - p_i)                     (f = sum_i p_i)
    d log p_i / d L_ij  = p_ij (1[j in C_i] / p_i - 1)                 (g = sum_i log p_i)

Call these W_ij. Each row of W sums to zero (softmax invariance), and with
dL_ij/dz_i = -2 (z_i - z_j), dL_ij/dz_j = -2 (z_j - z_i):

    d obj / d z_i += 2 sum_j W_ij z_j             (the row sums of W vanish)
    d obj / d z_j += 2 (sum_i W_ij z_i - (sum_i W_ij) z_j)

which is eqs 5 and 7 of the paper carried to the embedding (grad_A = grad_Z^T X).

How it is computed (evidence in benchmarks/README.md, the sections named):
* Points are sorted by class, so the same-class columns of a chunk of same-class rows are one
  contiguous slice: no N-wide mask is ever built.
* L'_ij = 2 z_i.z_j - ||z_j||^2 differs from L_ij by a per-row constant (||z_i||^2), which
  softmax ignores: one GEMM with a bias row gives the logits.
* On the CPU in float32 the row pass runs in C (:mod:`training.objectives.native_rows`:
  the GEMM writes z_i.z_j alone, and one pass turns them into e_ij = exp(-||z_i - z_j||^2)
  with their row and block sums; the division by the row's sum rides on r below; rows
  whose nearest point is far, whose sums are not finite, or whose same-class sum the
  pass's absolute cut may have thinned go to _far_rows; "The exact row pass in C").
  Elsewhere, and as the reference it is tested against:
* each row's p_ij come from torch's fused softmax, in place ("The row pass as a softmax"),
  those below float32's normal range then set to 0 (``numerics.zero_subnormal``: a product
  over subnormals ran 100x slower on an Intel Xeon);
  p_i is the sum of the row's same-class block, which needs no maximum of its own ("The
  row pass without a maximum of its own"). Rows whose p_i falls below P_FLOOR are
  recomputed by _far_rows from two log-sum-exps, so log p_i stays exact when every
  same-class point is far beyond exp's range (g stays finite).
* The (B, N) passes run in the embeddings' dtype; the per-row scalars made from them (p_i,
  log p_i, the factors that turn p_ij into W) and the sum over chunks in float64: in float32
  the gap of two large logits loses enough digits to make two fits of the same data
  diverge (tests/training/model/test_sparse_input.py).
* W = r U with a per-row scale r (B, 1): the (B, N) buffer holds U (p_ij, or the C pass's
  e_ij, the same-class block rescaled) and r is folded into the products' (B, d) and (N,)
  sides, two passes over (B, N) fewer (benchmarks/results/exact_row_scale.json).
* The products are taken about the query class's mean c (W's rows sum to zero, so the
  gradient is unchanged): the column terms W^T (z_q - c) and colsum(W)_j (z_j - c) then
  cancel less in float32.
* On the CPU the gradient's three products (add_gradient_products) run over tiles of
  PRODUCT_TILE columns of U, so that one read of U from memory serves all three ("The
  gradient's products over column tiles").
* An exact pass whose z does not require grad (built under ``torch.no_grad``: the
  finish's start scale, the objective at a map, the candidate audit's exact objective)
  computes the value alone: the logits and their row passes, without the gradient's
  products. The candidate sets' pass computes its gradient either way.
Peak memory: O(chunk x N + N d).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from training.numerics import TINY_P, PrecomputedGradient, chunk_rows, class_runs, zero_subnormal
from training.objectives import native_candidates, native_rows, nca_flex


def _zero_unless(keep: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values where keep, else 0 (also where values is inf or nan)."""
    return torch.where(keep, values, torch.zeros_like(values))


# A row whose same-class mass p_i (the block's sum of the row's softmax) is below this is
# recomputed by _far_rows. A margin: the row pass sets p_ij at or below
# numerics.TINY_P (3.9e-31) to 0, and up to n_c of them are then missing from p_i; above
# 1e-18 that is below float32's resolution of p_i for classes of up to 1.5e5 points (n_c
# TINY_P / P_FLOOR < eps / 2), and below it the far rows' recomputation is exact; rows
# this far from their class are rare
P_FLOOR = 1e-18
# ... and through the C row pass, whose cut at exp(-70) is absolute rather than relative to
# the row's sum S_i (e_ij = exp(-||z_i - z_j||^2) with S_i down to exp(-20)): a row is
# recomputed unless its same-class sum S^c_i is at least this many times its class's
# size, so that the n_c cut exps (each below exp(-70)) stay below eps / 2 of it
NATIVE_BLOCK_FLOOR = 2.0 * TINY_P / float(torch.finfo(torch.float32).eps)  # 6.6e-24
BLOCK_FACTOR_MIN = float(torch.finfo(torch.float32).eps) / 2  # the least nonzero block factor
# columns of a chunk's U (B, N) whose three gradient products run together while they are
# in cache (4 MiB at B = 256); on the CPU only: a GPU has no such cache to keep them in
PRODUCT_TILE = 4096


def _scores_and_row_scale(
    logits: torch.Tensor,
    s: int,
    e: int,
    log_form: bool,
    recompute: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the rows' scores, r (B, 1)) for one block of rows, all of one class; leaves U
    (B, M) in ``logits`` such that W = d score_i / d L_ij = r_i U_ij.

    logits: (B, M) = L_ij + c_i (any per-row constant), -inf where j is not a neighbour;
    columns [s, e) are the rows' same-class neighbours. One softmax over the row, in place
    (torch's fused row kernel: the maximum, the exps and their sum in few passes), and the
    block's sum:

        p_ij = softmax_j(L_ij),    p_i = sum_{j in block} p_ij

    Off the block U_ij = p_ij; on it U_ij = (p_i - 1) p_ij / p_i (= (p_i - 1) q_ij, q the
    softmax of the block alone), and

        f = sum p_i:      r_i = -p_i    (W = -p_ij p_i off the block, p_ij (1 - p_i) on it)
        g = sum log p_i:  r_i = -1      (W = -p_ij off the block, p_ij (1 / p_i - 1) on it)

    The callers fold r into their products (a (B, d) scale instead of a pass over (B, M)).
    Rows with p_i below P_FLOOR (also 0 and NaN) are taken again from ``recompute(rows)``,
    their original logits (b, M), by :func:`_far_rows`, which keeps log p_i exact far beyond
    exp's range. ``logits`` must be contiguous: the in-place softmax writes it as such.
    """
    if not logits.is_contiguous():
        raise ValueError(f"logits of shape {tuple(logits.shape)} must be contiguous")
    dtype = logits.dtype
    torch.ops.aten._softmax.out(logits, 1, False, out=logits)  # (B, M) p_ij, in place
    zero_subnormal(logits)
    block = logits[:, s:e]  # (B, n_c) view
    p = block.sum(1, keepdim=True).to(torch.float64)  # (B, 1) p_i (a cascaded sum)
    block.mul_(((p - 1.0) / p).to(dtype))  # (p_i - 1) q_ij; inf or NaN on far rows (below)
    score, row_scale = (torch.log(p), -torch.ones_like(p)) if log_form else (p, -p)
    far = torch.nonzero(~(p >= P_FLOOR))[:, 0]  # (b,) rows below the floor, or NaN
    if far.numel():
        original = recompute(far)  # (b, M)
        score[far], row_scale[far] = _far_rows(original, s, e, log_form)
        logits[far] = original
    return score.sum(), row_scale.to(dtype)


def _native_scores_and_row_scale(
    dots: torch.Tensor,
    sq: torch.Tensor,
    q: torch.Tensor,
    s: int,
    e: int,
    log_form: bool,
    recompute: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`_scores_and_row_scale` returns, from the dot products ``dots`` (B, N) =
    z_i.z_j of a block of rows of one class at sorted positions q (B,), through the C row
    pass (:mod:`training.objectives.native_rows`): it leaves the unnormalised exps
    e_ij = exp(-||z_i - z_j||^2) in ``dots`` with their sums S_i and S^c_i (NaN for a row
    whose nearest point is far), so that p_ij = e_ij / S_i and p_i = S^c_i / S_i,
    and U and r keep W = r U with U_ij = e_ij off the block, (p_i - 1) / p_i e_ij on it
    (the factor 0 where it is below BLOCK_FACTOR_MIN), and r_i = -p_i / S_i (f) or
    -1 / S_i (g): the division by S_i rides on r, a (B, 1) scale.
    Rows whose p_i is below P_FLOOR or not finite, or whose S^c_i is below
    NATIVE_BLOCK_FLOOR a same-class point, are taken again by :func:`_far_rows`."""
    row_sum, block_sum = native_rows.exp_rows(dots, sq, q, (s, e))  # (B,), (B,) float64
    p = (block_sum / row_sum)[:, None]  # (B, 1) p_i
    # the block's factor (p_i - 1) / p_i, 0 where it is below float32's resolution of 1 (as
    # a float32 p_i would make it): at least eps / 2 where it is not, so that times a kept
    # e_ij (above TINY_P) it stays a normal float, never a subnormal in the products
    factor = (p - 1.0) / p  # (B, 1) float64; inf or NaN on far rows (below)
    factor[factor.abs() < BLOCK_FACTOR_MIN] = 0.0
    dots[:, s:e].mul_(factor.to(dots.dtype))
    score, row_scale = (torch.log(p), -torch.ones_like(p)) if log_form else (p, -p)
    row_scale = row_scale / row_sum[:, None]
    # rows below the floor, or NaN, or whose block the absolute cut may have thinned
    exact = (p[:, 0] >= P_FLOOR) & (block_sum >= (e - s) * NATIVE_BLOCK_FLOOR)
    far = torch.nonzero(~exact)[:, 0]  # (b,)
    if far.numel():
        original = recompute(far)  # (b, N)
        score[far], row_scale[far] = _far_rows(original, s, e, log_form)
        dots[far] = original
    return score.sum(), row_scale.to(dots.dtype)


def _far_rows(
    logits: torch.Tensor, s: int, e: int, log_form: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(score_i (b, 1), r (b, 1)), both float64, for rows whose same-class mass may be below
    float range; leaves U in ``logits`` (b, M) as :func:`_scores_and_row_scale` does. Two
    softmaxes, of the row and of the block alone (q_ij = p_ij / p_i on the block), and
    log p_i = lse_block_i - lse_i from the two log-sum-exps, each m - log(softmax at the
    maximum) (that softmax is 1 / sum_j exp(L_ij - m)): log p_i stays exact when every
    same-class point lies far beyond exp's range. A row with no finite same-class logit
    scores 0 and gets r = 0; its block in U is NaN (all of its U when no logit is finite),
    which the candidate path's padding mask clears. In the exact path every row has a finite
    same-class logit unless z is not finite, and then the NaN reaches the gradient, which the
    fit refuses.
    """
    dtype, wide = logits.dtype, torch.float64
    same = logits[:, s:e]  # (b, n_c) view
    m_same = same.amax(1, keepdim=True)  # (b, 1)
    has_same = torch.isfinite(m_same)  # (b, 1)
    q = torch.softmax(same, 1)  # (b, n_c) new buffer; NaN in a row without a finite logit
    m_all = logits.amax(1, keepdim=True)  # (b, 1)
    torch.ops.aten._softmax.out(logits, 1, False, out=logits)  # (b, M) p_ij, in place
    zero_subnormal(logits)
    lse_same = m_same.to(wide) - torch.log(q.amax(1, keepdim=True).to(wide))  # (b, 1)
    lse_all = m_all.to(wide) - torch.log(logits.amax(1, keepdim=True).to(wide))
    log_p = _zero_unless(has_same, lse_same - lse_all)  # (b, 1), <= 0
    if log_form:
        score, row_scale = log_p, -torch.ones_like(log_p)
    else:
        score = torch.exp(log_p)
        row_scale = -score
    # (p_i - 1) q_ij; the amax of q and of the row above read their maxima, never 0
    logits[:, s:e] = zero_subnormal(q).mul_(torch.expm1(log_p).to(dtype))
    return _zero_unless(has_same, score), _zero_unless(has_same, row_scale)


def add_gradient_products(
    units: torch.Tensor,
    row_scale: torch.Tensor,
    centred: torch.Tensor,
    q: torch.Tensor,
    grad: torch.Tensor,
    col_total: torch.Tensor,
    tile: int,
) -> None:
    """Add one chunk's products to the gradient grad (N, d) and to col_total (N,), from its
    U (B, N), r (B, 1), the points about their class centre c (N, d) and its rows q (B,):

        d/dz_i += 2 r_i U_i (z - c)          (the chunk's rows)
        d/dz_j += 2 U^T (r (z_q - c))        (every point),   col_total += U^T r

    (W = r U; the caller subtracts 2 colsum(W)_j (z_j - c) once per class). U is read once,
    ``tile`` columns at a time: each tile's three products run while it is still in cache."""
    if tile < 1:
        raise ValueError(f"tile must be at least 1 column, got {tile}")
    weighted = centred[q] * row_scale  # (B, d) r (z_q - c)
    row_part = torch.zeros_like(weighted)  # (B, d) U (z - c)
    for j in range(0, units.shape[1], tile):
        columns = units[:, j : j + tile]  # (B, T)
        row_part.addmm_(columns, centred[j : j + tile])
        grad[j : j + tile].addmm_(columns.T, weighted, alpha=2.0)
        col_total[j : j + tile].addmv_(columns.T, row_scale[:, 0])
    grad.index_add_(0, q, row_part.mul_(row_scale), alpha=2.0)


def nca_value_and_grad(
    z: torch.Tensor,
    labels: torch.Tensor,
    *,
    log_form: bool,
    rows: torch.Tensor | None = None,
    chunk_size: int | None = None,
    flex: bool | None = None,
    native: bool | None = None,
    with_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum_{i in rows} score_i, d/dz of that sum (N, d)) for f (or g when log_form).

    z: (N, d) embeddings, labels: (N,) class ids, rows: (B,) query rows (default: all).
    Rows whose class has no other member score 0 and contribute no gradient.
    flex: the fused attention passes of :mod:`training.objectives.nca_flex` (True), or
    whenever they can run (None: float32 on CUDA); otherwise the chunked torch path below,
    whose chunk is ``chunk_size`` rows and whose row pass runs in C (native True; None:
    whenever :func:`training.objectives.native_rows.usable`) or in torch (False).
    ``with_grad`` False: the value alone (the gradient None), which the chunked path
    computes without the gradient's products, about half of an evaluation's time (the flex
    path computes the gradient all the same and drops it).
    """
    n = z.shape[0]
    z = z.detach()
    order = torch.argsort(labels, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=z.device)
    zs = z[order]  # (N, d) sorted by class
    ys = labels[order]
    runs = class_runs(ys)
    if rows is None:
        query_sorted = torch.arange(n, device=z.device)
    else:
        query_sorted = torch.sort(
            inverse[rows]
        ).values  # positions in sorted order, grouped by class
    # Group query positions by class run.
    run_starts = torch.tensor([s for s, _ in runs], device=z.device)
    run_of_query = torch.searchsorted(run_starts, query_sorted, right=True) - 1

    run_ends = torch.tensor([e for _, e in runs], device=z.device)
    query_start, query_end = run_starts[run_of_query], run_ends[run_of_query]
    keep = query_end - query_start >= 2  # no same-class neighbour: p_i = 0 whatever A is
    fused = None
    if flex or (flex is None and nca_flex.usable(zs)):
        fused = nca_flex.try_exact_value_and_grad(zs, ys, query_sorted[keep], log_form=log_form)
    if fused is not None:
        return fused[0], fused[1][inverse] if with_grad else None
    if native is None:
        native = native_rows.usable(zs)
    elif native and not native_rows.usable(zs):
        raise ValueError(
            "native=True needs finite float32 embeddings on the CPU and the C row pass built "
            f"(got {zs.dtype} on {zs.device}, finite: {bool(torch.isfinite(zs).all())})"
        )
    total, grad_s = _torch_value_and_grad(
        zs, runs, query_sorted, run_of_query, log_form, chunk_size, with_grad, native
    )
    return total, None if grad_s is None else grad_s[inverse]


def _torch_value_and_grad(
    zs,
    runs,
    query_sorted,
    run_of_query,
    log_form: bool,
    chunk_size,
    with_grad: bool = True,
    native: bool = False,
):
    """The chunked path on class-sorted embeddings zs (N, d): chunks of each class run's
    query rows against all points, one GEMM for the logits (with ``native``, for the dot
    products the C row pass turns into U); (value, gradient (N, d) sorted, or None without
    ``with_grad``)."""
    n = zs.shape[0]
    sq = (zs * zs).sum(1)  # (N,)
    neg_sq = -sq[None, :]  # (1, N)
    total = torch.zeros((), dtype=torch.float64, device=zs.device)
    if chunk_size is None:
        # at most 256 rows, fewer where the (B, N) buffer and the recomputed logits of a
        # chunk's far rows (_far_rows; rare) would pass the memory budget (2 floats a pair)
        chunk_size = min(256, chunk_rows(n, floats_per_pair=2))
    # one (chunk, N) buffer for every chunk's logits (then U, in place): a fresh one per
    # chunk costs page faults on every new mapping
    buffer = torch.empty((min(chunk_size, n), n), dtype=zs.dtype, device=zs.device)
    if with_grad:
        tile = PRODUCT_TILE if zs.device.type == "cpu" else n  # a GPU: one tile (the whole U)
        grad_s = torch.zeros_like(zs)  # (N, d)
        centred = torch.empty_like(zs)  # (N, d) z_j - c, filled for each class
        col_total = torch.empty(n, dtype=zs.dtype, device=zs.device)  # sum_i W_ij, each class
    for r, (s, e) in enumerate(runs):
        q_run = query_sorted[run_of_query == r]
        if e - s < 2 or q_run.shape[0] == 0:
            continue  # no same-class neighbour (p_i = 0 whatever A is), or no query row
        if with_grad:
            # W's rows sum to zero, so the gradient is the same with every z taken about any
            # point c: about the class's mean its two column terms cancel less (float32)
            torch.sub(zs, zs[s:e].mean(0), out=centred)
            col_total.zero_()
        for start in range(0, q_run.shape[0], chunk_size):
            q = q_run[start : start + chunk_size]  # (B,) sorted positions, all of class r
            b = q.shape[0]
            recompute = functools.partial(_far_logits, zs, neg_sq, q)
            if native:
                logits = torch.mm(zs[q], zs.T, out=buffer[:b])  # (B, N) z_i.z_j
                value, row_scale = _native_scores_and_row_scale(
                    logits, sq, q, s, e, log_form, recompute
                )
            else:
                logits = _exact_logits(zs, neg_sq, q, out=buffer[:b])  # (B, N)
                value, row_scale = _scores_and_row_scale(logits, s, e, log_form, recompute)
            units = logits  # (B, N) U, W = row_scale U; U_ii = 0 (the diagonal is in [s, e))
            total += value
            if not with_grad:
                continue
            add_gradient_products(units, row_scale, centred, q, grad_s, col_total, tile)
        if with_grad:
            grad_s.addcmul_(col_total[:, None], centred, value=-2.0)
    return total.to(zs.dtype), grad_s if with_grad else None


def _far_logits(zs: torch.Tensor, neg_sq: torch.Tensor, q: torch.Tensor, far: torch.Tensor):
    """The logits (b, N) of a chunk's far rows (``far`` indexes its sorted positions q)."""
    return _exact_logits(zs, neg_sq, q[far])


def _exact_logits(
    zs: torch.Tensor, neg_sq: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, N) logits L_ij + ||z_i||^2 = 2 z_i.z_j - ||z_j||^2 of the sorted positions q (B,)
    against every point, -inf where j = i (into ``out`` when given)."""
    logits = torch.addmm(neg_sq, zs[q], zs.T, alpha=2.0, out=out)
    logits[torch.arange(q.shape[0], device=zs.device), q] = float("-inf")
    return logits


def nca_value_and_grad_candidates(
    z: torch.Tensor,
    labels: torch.Tensor,
    candidates: torch.Tensor,
    *,
    log_form: bool,
    rows: torch.Tensor | None = None,
    chunk_size: int | None = None,
    native: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same value and gradient with each row's neighbours restricted to its candidates.

    candidates: (N, M) with same-class indices in the first half and other-class indices in
    the second, -1 for padding (:func:`training.objectives.neighbourhood.nearest_candidates`).
    Per chunk of B rows the candidates' embeddings are gathered once (B, M, d) and reused for
    the logits and both gradient terms; the candidates' share of the gradient is scattered
    back with ``index_add_``. native: the C kernel of
    :mod:`training.objectives.native_candidates` (True), this torch path (False), or the C
    kernel whenever it can run (None).
    """
    n, d = z.shape
    z = z.detach()
    m = candidates.shape[1]
    k_same = m // 2
    if native is None:
        native = native_candidates.usable(z, m)
    if native:
        every = torch.arange(n, device=z.device) if rows is None else rows
        return native_candidates.value_and_grad(
            z,
            every,
            candidates[every],
            k_same=k_same,
            log_form=log_form,
        )
    sq = (z * z).sum(1)  # (N,)
    grad = torch.zeros_like(z)
    total = torch.zeros((), dtype=torch.float64, device=z.device)  # the chunks' scores
    if rows is None:
        rows = torch.arange(n, device=z.device)
    if chunk_size is None:
        chunk_size = 1024
    for start in range(0, rows.shape[0], chunk_size):
        q = rows[start : start + chunk_size]  # (B,)
        idx = candidates[q]  # (B, M)
        invalid = idx < 0
        safe = idx.clamp_min(0)
        zc = z.index_select(0, safe.reshape(-1)).view(q.shape[0], m, d)  # (B, M, d)
        zq = z[q]  # (B, d)
        parts = (zq, zc, sq[safe], invalid)
        logits = _candidate_logits(*parts)  # (B, M)
        value, row_scale = _scores_and_row_scale(
            logits, 0, k_same, log_form, functools.partial(_candidate_logits, *parts)
        )
        weights = logits.mul_(row_scale).masked_fill_(invalid, 0.0)  # (B, M) W
        total += value
        # d/dz_i: 2 sum_c W_ic z_c ; d/dz_c: 2 W_ic (z_i - z_c)
        grad.index_add_(0, q, 2.0 * torch.bmm(weights.unsqueeze(1), zc).squeeze(1))
        to_candidates = (zq.unsqueeze(1) - zc).mul_(2.0 * weights.unsqueeze(2))  # (B, M, d)
        grad.index_add_(0, safe.reshape(-1), to_candidates.view(-1, d))
    return total.to(z.dtype), grad


def _candidate_logits(zq, zc, sq_c, invalid, rows=slice(None)) -> torch.Tensor:
    """(b, M) logits L_ic + ||z_i||^2, -inf at padding, of a chunk's ``rows``: zq (B, d)
    its embeddings, zc (B, M, d) and sq_c (B, M) its candidates' embeddings and squared
    norms, invalid (B, M) the padding."""
    logits = torch.bmm(zc[rows], zq[rows].unsqueeze(2)).squeeze(2).mul_(2.0).sub_(sq_c[rows])
    return logits.masked_fill_(invalid[rows], float("-inf"))


class FusedNCA(PrecomputedGradient):
    """Autograd wrapper: value = sum_i score_i(z); backward returns the fused gradient."""

    @staticmethod
    def forward(ctx, z, labels, log_form, rows, candidates, chunk_size):
        if candidates is None:
            # z does not require grad (built under torch.no_grad): the value alone
            value, grad = nca_value_and_grad(
                z,
                labels,
                log_form=log_form,
                rows=rows,
                chunk_size=chunk_size,
                with_grad=ctx.needs_input_grad[0],
            )
            if grad is None:
                return value
        else:
            value, grad = nca_value_and_grad_candidates(
                z,
                labels,
                candidates,
                log_form=log_form,
                rows=rows,
                chunk_size=chunk_size,
            )
        ctx.save_for_backward(grad)
        return value
