"""The one inference path: the only place the service embeds, searches and decides.

Once its wire has parsed a request into rows and a :class:`Query` (:func:`resolve`, the same
checks and messages for every wire), the engine (``service.engine.engine``) runs it through
:func:`infer`, directly or merged with other requests by the batcher
(``service.engine.batcher``).

For rows x (n, D) of one model and one k, :func:`infer` computes::

    z = x W^T + b                     embed (float64 accumulation, float32 result)
    rows whose z is not finite        -> that part's InvalidInput, the others go on
    (dist, idx) = kNN(z, k)           one search for every part (service.search.index)
    background = FarPrior(z, t)       the soft_prior rule's component, per threshold t
    (label, proba) = decide(...)      one decision per (rule, threshold) asked for

The projection, the final distances and the decision are computed row by row
(service.core.knn), so a part's answer does not depend on the parts searched with it: a
batched answer equals the answer the request gets alone (but for rows whose float64
projection cancels: service.core.knn's docstring).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.core.knn import decide, outlier_threshold, project
from service.core.sparse import SparseRows, project_sparse
from service.core.vocabulary import RULES, DecisionRule
from service.errors import InvalidInput, ServiceError
from service.search.index import search

SOFT_PRIOR = DecisionRule.SOFT_PRIOR.value
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Query:
    """What a request asks of the model, resolved and checked (:func:`resolve`)."""

    k: int  # neighbours per row, 1 <= k <= min(max_k, N)
    rule: str | None  # the decision rule, or None for neighbours only
    threshold: float | None = None  # the outlier threshold at the request's quantile

    @property
    def decision_key(self) -> tuple[str, float | None] | None:
        """Queries with equal keys share one decision: the rule, and for soft_prior its
        threshold (the other rules do not depend on it)."""
        if self.rule is None:
            return None
        return (self.rule, self.threshold if self.rule == SOFT_PRIOR else None)


@dataclass(frozen=True)
class Answer:
    """What a search gives n queries: their k neighbours and, when a decision rule was asked
    for, the decision."""

    distances: np.ndarray  # (n, k) squared distances, float64, ascending
    indices: np.ndarray  # (n, k) reference row indices
    predicted: np.ndarray | None = None  # (n,) class indices
    probabilities: np.ndarray | None = None  # (n, C)
    outliers: np.ndarray | None = None  # (n,) bool: nearest distance beyond the threshold
    embedding: np.ndarray | None = None  # (n, d) float32, when the caller asked for it
    # where the time went, {"search" | "decide" | "queue": (start, end)} in epoch nanoseconds,
    # for the request's trace (service.ops.tracing); shared by every part of a merged batch
    timings: dict = field(default_factory=dict, compare=False)

    def rows(self, start: int, stop: int, decided: bool = True) -> Answer:
        """The answer of rows [start, stop) (views, no copies), without the decision when
        ``decided`` is False."""
        part = slice(start, stop)
        timings = dict(self.timings)
        if not decided or self.predicted is None:
            return Answer(self.distances[part], self.indices[part], timings=timings)
        return Answer(
            self.distances[part],
            self.indices[part],
            self.predicted[part],
            self.probabilities[part],
            timings=timings,
        )


def resolve(
    model,
    max_k: int,
    *,
    k: int | None = None,
    rule: str | None = None,
    quantile: float | None = None,
    decides: bool = True,
) -> Query:
    """A request's options against the model and the limits, the same for every wire.

    k: the model's default when None; InvalidInput over ``max_k`` or the number of
    references. rule (when the request ``decides``): the model's default when None.
    quantile: the outlier threshold through the model's calibration (None: the setting's);
    InvalidInput outside the calibrated range, or given to a model without a calibration.
    soft_prior needs a calibration.
    """
    k = model.default_k if k is None else k
    if k > max_k:
        raise InvalidInput(f"k={k} is over the limit max_k={max_k}")
    if not 1 <= k <= model.n_references:
        raise InvalidInput(
            f"k={k} must lie in [1, {model.n_references}] (the number of reference points)"
        )
    threshold = threshold_at(model, quantile)
    if threshold is None and quantile is not None:
        raise InvalidInput(
            f"outlier_quantile={quantile!r}: this model has no outlier calibration (it was "
            "trained without a validation split), so nothing is flagged; leave it out"
        )
    if not decides:
        return Query(k, None, threshold)
    rule = rule or model.decision_rule
    if rule not in RULES:
        raise InvalidInput(f"rule must be one of {list(RULES)}, got {rule!r}")
    if rule == SOFT_PRIOR and (threshold is None or model.far_prior is None):
        raise InvalidInput(
            "rule 'soft_prior' needs the model's outlier calibration, and this model has "
            "none (it was trained without a validation split); use 'majority' or 'soft'"
        )
    return Query(k, rule, threshold)


def threshold_at(model, quantile: float | None = None) -> float | None:
    """The squared nearest distance beyond which a query is an outlier at ``quantile``
    (None: the setting's, computed at load), or None when the model has no calibration.
    InvalidInput when the quantile is outside the calibrated range."""
    if model.outlier_quantiles is None:
        return None
    if quantile is None or quantile == model.default_outlier_quantile:
        return model.default_outlier_threshold
    try:
        return outlier_threshold(model.outlier_quantiles, quantile)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def embed(model, x: np.ndarray | SparseRows) -> np.ndarray:
    """x (n, D), dense or sparse -> z = x W^T + b (n, d) float32; InvalidInput naming the
    first row whose embedding is not finite in float32."""
    z = project_rows(model, [x])
    bad = non_finite_rows(z)
    if len(bad):
        field = "sparse_instances" if isinstance(x, SparseRows) else "instances"
        raise embedding_overflow(int(bad[0]), field)
    return z


def project_rows(model, parts: Sequence[np.ndarray | SparseRows]) -> np.ndarray:
    """The embeddings (sum n_i, d) float32 of the parts' rows in order: the dense parts by one
    projection of their concatenation (so a dense row's embedding is the one it gets in a
    batch of the same dense rows, whether sparse parts are merged beside them or not), the
    sparse ones by their non-zeros (``service.core.sparse``); overflow is left as inf for
    the caller to name."""
    dense = [part for part in parts if not isinstance(part, SparseRows)]
    with np.errstate(over="ignore", invalid="ignore"):
        if dense:  # one projection of every dense part, whatever sparse parts are beside them
            rows = dense[0] if len(dense) == 1 else np.concatenate(dense)
            z_dense = project(rows, model.projection, model.offset)
            if len(dense) == len(parts):
                return z_dense
        z_parts, start = [], 0
        for part in parts:
            if isinstance(part, SparseRows):
                z_parts.append(project_sparse(part, model.projection, model.offset))
            else:
                z_parts.append(z_dense[start : start + len(part)])
                start += len(part)
        return np.concatenate(z_parts)


def non_finite_rows(z: np.ndarray) -> np.ndarray:
    """Indices of the rows of z (n, d) with a value that is not a finite float32."""
    return np.flatnonzero(~np.isfinite(z).all(axis=1))


def embedding_overflow(row: int, field: str = "instances") -> InvalidInput:
    return InvalidInput(
        f"{field}[{row}] projects to an embedding beyond float32 range "
        f"(|z| > {FLOAT32_MAX:.4g}): its values are too large for this model's map; "
        "rows must have finite values whose embedding is finite"
    )


def infer(
    model, parts: Sequence[tuple[np.ndarray | SparseRows, Query]]
) -> list[Answer | ServiceError]:
    """The answers of ``parts`` (rows (n_i, D) float32 or ``SparseRows``, Query), all with
    the same k: one projection of the dense parts (sparse parts each by their non-zeros:
    :func:`project_rows`), one search and one decision per (rule, threshold). A part whose
    rows cannot be embedded (an embedding beyond float32) gets its own InvalidInput; the
    others are answered without it."""
    k = parts[0][1].k
    assert all(query.k == k for _, query in parts), "infer: one k per call"
    started = time.time_ns()
    z = project_rows(model, [rows for rows, _ in parts])  # (n, d)
    out: list[Answer | ServiceError | None] = [None] * len(parts)
    spans, start = [], 0  # (part, first row, end row) in z
    for i, (part_rows, _) in enumerate(parts):
        spans.append((i, start, start + len(part_rows)))
        start += len(part_rows)
    bad = non_finite_rows(z)
    if len(bad):
        keep = np.ones(len(z), dtype=bool)
        for i, a, b in spans:
            bad_here = bad[(bad >= a) & (bad < b)]
            if len(bad_here):
                field = "sparse_instances" if isinstance(parts[i][0], SparseRows) else "instances"
                out[i] = embedding_overflow(int(bad_here[0]) - a, field)
                keep[a:b] = False
        z = z[keep]
        spans = _served_spans(parts, out)
        if not spans:
            return out  # type: ignore[return-value]
    distances, indices = search(model, z, k)  # (m, k), (m, k)
    searched = time.time_ns()
    answer = _decided(model, z, distances, indices, [(parts[i][1], a, b) for i, a, b in spans])
    answer.timings.update(search=(started, searched), decide=(searched, time.time_ns()))
    for i, a, b in spans:
        out[i] = answer.rows(a, b, decided=parts[i][1].rule is not None)
    return out  # type: ignore[return-value]


def infer_one(model, rows: np.ndarray | SparseRows, query: Query) -> Answer:
    """:func:`infer` of one part; raises its error."""
    (result,) = infer(model, [(rows, query)])
    if isinstance(result, ServiceError):
        raise result
    return result


def _served_spans(parts, out) -> list[tuple[int, int, int]]:
    """(part, first row, end row) of the parts still to answer, in the rows kept."""
    spans, start = [], 0
    for i, (rows, _) in enumerate(parts):
        if out[i] is None:
            spans.append((i, start, start + len(rows)))
            start += len(rows)
    return spans


def _decided(model, z, distances, indices, spans: list[tuple[Query, int, int]]) -> Answer:
    """The neighbours with one decision for each (rule, threshold) the spans ask for."""
    keys = {query.decision_key for query, _, _ in spans} - {None}
    if not keys:
        return Answer(distances, indices)
    n, n_classes = len(distances), len(model.classes)
    predicted = np.zeros(n, dtype=np.int64)  # (n,)
    probabilities = np.zeros((n, n_classes), dtype=np.float64)  # (n, C)
    for key in keys:
        chosen = [(a, b) for query, a, b in spans if query.decision_key == key]
        if len(keys) == 1 and len(chosen) == len(spans):
            selected = slice(None)
        else:
            selected = np.concatenate([np.arange(a, b) for a, b in chosen])
        rule, threshold = key
        background = None
        if rule == SOFT_PRIOR:
            background = model.far_prior.background(z[selected], threshold)
        predicted[selected], probabilities[selected] = decide(
            model.labels[indices[selected]], distances[selected], n_classes, rule, background
        )
    return Answer(distances, indices, predicted, probabilities)
