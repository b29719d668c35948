"""The initial map: its direction, a transformation A (d, D) on standardised inputs, and its
scale.

**The direction.** ``auto`` follows scikit-learn's rule: LDA when d <= min(D, C - 1), else
PCA when d < min(D, N), else the identity. ``pca`` takes the top-d principal axes, ``lda``
the first d LDA scalings, ``identity`` the first d rows of I, ``random`` a standard normal
matrix; an explicit (d, D) array or an artifact directory (warm start) is used as given.

PCA and LDA come from scatter matrices reduced over blocks and ranks
(``training.distributed.sharded_stats``); where the data has fewer directions than d they
complete the basis, so every ordering of N, D, C and d gets a (d, D) map
(``tests/training/model/test_helpers.py``).

**The scale** of the maps built here. NCA's neighbour probabilities
p_ij = softmax_j(-||A x_i - A x_j||^2) depend on the scale of A: a map that is too large
makes every point's nearest neighbour take all the probability (the softmax is saturated
and its gradient vanishes for all but a few points), one that is too small spreads it over
the whole class. The PCA, LDA, identity and random maps have no reason to sit at a good
scale (standardised pixels put PCA's 32 directions where p_i is 0 or 1 for almost every
point, and the fit ends worse from there: ``benchmarks/results/mnist_init_scale.json``).

So the initial map A0 is replaced by s* A0 with

    s* = argmax_s  (1/B) sum_{i in rows} log p_i(s A0),   p_i = sum_{j in C_i} p_ij,

the mean log-probability that a sample row's neighbour has its class (NCA's g, eq 6, on B
evenly spaced rows against every training point): the temperature at which the softmax is
as sharp as the data supports, and no sharper. s* is found on an octave grid around the
scale s0 at which the median nearest-neighbour logit is -1, then refined around the best by
eighths of an octave; each row block's squared distances are computed once and reused for
every s. Cost O(B N d) for the distances and O(G B N) for the G = 24 grid points'
exponentials.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from service.core.artifact import read_artifact
from training.numerics import EXP_FLOOR, evenly_spaced_rows

INIT_NAMES = ("auto", "pca", "lda", "identity", "random")


def resolve_auto(n_components: int, n_features: int, n_samples: int, n_classes: int) -> str:
    """scikit-learn's rule, except that LDA also needs more samples than classes."""
    if n_components <= min(n_features, n_classes - 1) and n_samples > n_classes:
        return "lda"
    if n_components < min(n_features, n_samples):
        return "pca"
    return "identity"


def checked_array_init(init: np.ndarray, n_features: int, n_components: int) -> np.ndarray:
    """A copy of an array init A (d, D) as float64, checked as scikit-learn checks it."""
    A = np.asarray(init, dtype=np.float64)
    if A.ndim != 2:
        raise ValueError(f"init must be a 2-D array (n_components, n_features), got {A.shape}")
    if A.shape[1] != n_features:
        raise ValueError(
            f"The input dimensionality ({A.shape[1]}) of the given linear transformation "
            f"`init` must match the dimensionality of the given inputs `X` ({n_features})."
        )
    if A.shape[0] > A.shape[1]:
        raise ValueError(
            f"The output dimensionality ({A.shape[0]}) of the given linear transformation "
            f"`init` cannot be greater than its input dimensionality ({A.shape[1]})."
        )
    if A.shape[0] != n_components:
        raise ValueError(
            "The preferred dimensionality of the projected space `n_components` "
            f"({n_components}) does not match the output dimensionality of the given linear "
            f"transformation `init` ({A.shape[0]})!"
        )
    if not np.all(np.isfinite(A)):
        raise ValueError("init: contains NaN or Inf")
    return A.copy()


def check_lda(n_components: int, n_samples: int, n_features: int, n_classes: int) -> None:
    """ValueError unless LDA can give d components: d <= min(D, C - 1), and N > C."""
    if n_components > min(n_features, n_classes - 1):
        raise ValueError(
            f"init='lda' gives at most min(n_features, n_classes - 1) = "
            f"{min(n_features, n_classes - 1)} components, n_components={n_components}"
        )
    if n_samples <= n_classes:
        raise ValueError(
            f"init='lda' needs more samples than classes, got n_samples={n_samples} and "
            f"{n_classes} classes; use init='pca'"
        )


def served_map_scale(artifact) -> float:
    """The factor by which the job multiplied the fitted map to serve its soft vote at a
    temperature (the manifest's ``metrics.map_scale``, ``training.job.evaluate``); 1 when
    the artifact has none. A warm start divides it out: it resumes from the fitted map.
    ValueError naming the artifact when the manifest holds something other than a positive
    finite number."""
    value = (artifact.manifest.get("metrics") or {}).get("map_scale", 1.0)
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is None or not np.isfinite(number) or number <= 0:
        raise ValueError(
            f"init={str(artifact.path)!r}: the manifest's metrics.map_scale is {value!r}; "
            "expected a positive finite number (the factor the served map carries)"
        )
    return float(number)


def initial_components(
    init,
    X: np.ndarray,
    n_components: int,
    *,
    random_state: np.random.Generator,
    scale: np.ndarray | None = None,
) -> tuple[np.ndarray, str]:
    """Return (A (d, D) float64, the name of the rule used) for the rules that need no
    statistics of the data: an artifact directory (warm start), an array, ``identity`` and
    ``random``. PCA and LDA (also what ``auto`` resolves to, :func:`resolve_auto`) are
    computed from scatter matrices reduced over blocks and ranks
    (``training.distributed.sharded_stats``, ``training.model.preparation.initialize``).

    X: (N, D) standardised training inputs. ``scale`` (D,) is the current standardisation,
    used to carry a warm-start artifact's map over unchanged on raw inputs: A = W_old * scale.
    """
    n_features = X.shape[1]
    if isinstance(init, (str, Path)) and str(init) not in INIT_NAMES:
        artifact = read_artifact(init)
        if artifact.n_features_in != n_features:
            raise ValueError(
                f"init={str(init)!r}: the artifact expects {artifact.n_features_in} features, "
                f"the data has {n_features}"
            )
        s = np.ones(n_features) if scale is None else scale
        fitted = np.asarray(artifact.projection, dtype=np.float64) / served_map_scale(artifact)
        init = fitted * s[None, :]
        name = "artifact"
    elif isinstance(init, np.ndarray):
        name = "array"
    else:
        name = str(init)
    if isinstance(init, np.ndarray):
        return checked_array_init(init, n_features, n_components), name

    if name == "identity":
        return np.eye(n_components, n_features), name
    if name == "random":
        return random_state.standard_normal((n_components, n_features)), name
    raise ValueError(
        f"init={init!r} here must be 'identity', 'random', an array of shape (n_components, "
        "n_features) or an artifact directory ('auto', 'pca' and 'lda' are computed by "
        "training.distributed.sharded_stats)"
    )


# ------------------------------------------------------------------ the scale


# sample rows the log-likelihood is averaged over: 256, fewer from 131,072 points (at least
# 64), so that the G x B x N exponentials stay near 2^31 (a few seconds on two cores)
CALIBRATION_ROWS, MIN_CALIBRATION_ROWS, CALIBRATION_PAIRS = 256, 64, 2**25
BLOCK_ROWS = 32  # rows whose (rows, N) distances are held at once
FAR = 1e30  # the squared distance that stands for "not a neighbour": e^{-t FAR} = 0
# factors of s0 (the scale at which the median nearest-neighbour logit is -1) tried first ...
COARSE = [2.0**k for k in range(-3, 6)]
FINE = [2.0 ** (k / 8) for k in range(-7, 8)]  # ... then around the best of them


def mean_log_likelihood(
    z: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, scales: list[float]
) -> np.ndarray:
    """For each factor s in ``scales``, the mean over ``rows`` (B,) of log p_i of the
    embedding s z (z: (N, d), labels (N,)); rows whose class has no other member are left
    out. With t = s^2, m_i the row's smallest squared distance and m^s_i its smallest to its
    own class,

        log p_i = -t (m^s_i - m_i) + log sum_{j in C_i} e^{-t (d_ij - m^s_i)}
                  - log sum_{j != i} e^{-t (d_ij - m_i)},

    every exponent <= 0 and each sum >= 1 (finite arithmetic throughout: no -inf enters an
    exponential, and exponents are floored at EXP_FLOOR). float64 sums; (len(scales),)."""
    sq = (z * z).sum(1)  # (N,)
    totals = torch.zeros(len(scales), dtype=torch.float64)
    counted = 0
    for block in rows.split(BLOCK_ROWS):
        d2 = (sq[block][:, None] + sq[None, :] - 2.0 * (z[block] @ z.T)).clamp_min_(0.0)
        own = torch.arange(block.shape[0])
        d2[own, block] = FAR  # j != i
        same = labels[None, :] == labels[block][:, None]  # (b, N)
        same[own, block] = False
        d2_same = torch.where(same, d2, torch.full_like(d2, FAR))
        m_all, m_same = d2.amin(1), d2_same.amin(1)  # (b,)
        has_same = m_same < FAR
        if not bool(has_same.any()):
            continue
        counted += int(has_same.sum())
        gap_all = (d2 - m_all[:, None])[has_same]  # (b', N) >= 0
        gap_same = (d2_same - m_same[:, None])[has_same]
        offset = (m_same - m_all)[has_same]  # (b',)
        for i, s in enumerate(scales):
            t = s * s
            # exponents floored at EXP_FLOOR: exp's subnormal path is several times slower,
            # and e^-80 per point is far below the precision of a sum >= 1
            log_all = torch.log((gap_all * -t).clamp_min_(EXP_FLOOR).exp_().sum(1))
            log_same = torch.log((gap_same * -t).clamp_min_(EXP_FLOOR).exp_().sum(1))
            totals[i] += (log_same - log_all - t * offset).double().sum()
    return (totals / max(counted, 1)).numpy()


def nearest_scale(z: torch.Tensor, rows: torch.Tensor) -> float:
    """s0 = 1 / sqrt(median over ``rows`` of the squared distance to the nearest other
    point): at s0 the median row's nearest neighbour has logit -1."""
    sq = (z * z).sum(1)
    nearest = []
    for block in rows.split(BLOCK_ROWS):
        d2 = (sq[block][:, None] + sq[None, :] - 2.0 * (z[block] @ z.T)).clamp_min_(0.0)
        d2[torch.arange(block.shape[0]), block] = FAR
        nearest.append(d2.amin(1))
    median = float(torch.cat(nearest).median())
    return 1.0 / np.sqrt(median) if median > 0 else 1.0


def best_scale(z: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor) -> float:
    """s* (see the module docstring): the best of s0 x COARSE (an octave grid from an eighth
    of s0 to 32 s0, which holds the maximum: below, the softmax spreads over whole classes;
    above, the nearest neighbour takes it all), then of FINE around it."""
    s0 = nearest_scale(z, rows)
    coarse = [s0 * f for f in COARSE]
    best = coarse[int(np.argmax(mean_log_likelihood(z, labels, rows, coarse)))]
    fine = [best * f for f in FINE]
    return float(fine[int(np.argmax(mean_log_likelihood(z, labels, rows, fine)))])


def calibrated(A0: np.ndarray, z: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float]:
    """(s* A0, s*) for the initial map A0 whose embedding of every training row is z (N, d)
    float32, labels (N,): the log-likelihood is averaged over CALIBRATION_ROWS evenly
    spaced rows (all when fewer). A map that embeds every point at one place has no scale to
    choose and comes back unchanged (s* = 1), as does the map of a single class (p_i = 1 at
    every scale)."""
    zt = torch.as_tensor(np.ascontiguousarray(z, dtype=np.float32))
    if zt.numel() == 0 or not bool(torch.isfinite(zt).all()) or float(zt.abs().max()) == 0.0:
        return A0, 1.0
    if len(np.unique(labels)) < 2:  # one class: every p_i is 1 at any scale
        return A0, 1.0
    y = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    count = max(MIN_CALIBRATION_ROWS, min(CALIBRATION_ROWS, CALIBRATION_PAIRS // len(z)))
    rows = torch.as_tensor(evenly_spaced_rows(len(z), count))
    with torch.no_grad():
        s = best_scale(zt, y, rows)
    return A0 * s, s
