"""Prebuilt approximate indexes, tuned on the artifact's validation split.

    python -m service.search.tuning ARTIFACT --index ivf [--agreement 0.998]

builds an IVF, HNSW or IVF-PQ index over the artifact's references, chooses its search
parameter (IVF/IVF-PQ ``nprobe``, HNSW ``efSearch``) and writes the index into the artifact
as ``index.faiss`` (the whole artifact is rewritten atomically, so it gets a new model
version; a service polling the path picks it up). The service then loads the index instead
of building it, with the chosen parameter.

An approximate index is judged by what users see, not by recall: the **label agreement** of
a setting is the fraction of validation queries whose predicted label (the artifact's
decision rule and default k) equals exact search's, and its **accuracy delta** the change in
validation accuracy. A setting *reaches* the target when the one-sided Wilson lower bound of
its agreement (``--confidence``, default 95 %) does: with 5,000 validation queries and a
0.998 target that means at most 4 disagreements, so that the agreement holds on
queries the tuner has not seen, not only on the ones it chose by (choosing the best of many
settings on the same queries overstates agreement otherwise).
Settings are tried from the cheapest up until one reaches the target.
Then two-stage plans (``service.search.index.search_with_recheck``) are scored from the same runs: a
cheap setting for every row and a wider one for the rows whose vote margin is below m. The
few plans estimated cheapest that reach the target are measured as the service runs them,
and the fastest measured setting or plan wins. Every search goes through the service's own
path (``service.search.index.search_with_recheck``: k + margin candidates, exact re-rank), in batches
of 64 on one thread, as the service runs it. Recall@k against exact search is reported too.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist

import faiss
import numpy as np

from service.core.artifact import (
    Artifact,
    ArtifactError,
    OutputClaim,
    read_artifact,
    rewrite_artifact,
)
from service.core.knn import decide
from service.core.vocabulary import IVF_KINDS
from service.search.index import (
    IndexParams,
    build_index,
    configure,
    search_with_recheck,
    vote_margin,
)

# candidate values of each kind's search parameter, cheapest first
SEARCH_PARAMETER: dict[str, tuple[str, tuple[int, ...]]] = {
    "ivf": ("nprobe", (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)),
    "ivfpq": ("nprobe", (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)),
    "hnsw": ("ef_search", (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)),
}
DEFAULT_AGREEMENT = 0.998
DEFAULT_CONFIDENCE = 0.95
BATCH_ROWS = 64  # queries per search while tuning, as a busy service batches them
SETTINGS_PAST_TARGET = 3  # single-stage settings measured past the first reaching the target
PLANS_MEASURED = 3  # two-stage plans (cheapest by estimate) measured for real


class TuningError(ValueError):
    """The index cannot be tuned as asked (no validation split, target not reachable...)."""


@dataclass(frozen=True)
class Trial:
    """One setting measured on the validation queries."""

    value: int  # nprobe or efSearch (0 for exact search)
    label_agreement: float  # fraction of queries predicted as exact search predicts them
    accuracy: float  # validation accuracy with this setting
    recall_at_k: float  # mean |approximate k-NN & exact k-NN| / k
    microseconds_per_query: float  # search_with_recheck, batches of 64, one thread
    agreement_bound: float = 0.0  # lower confidence bound of label_agreement
    recheck_value: int = 0  # second-stage nprobe / efSearch (0: one stage)
    recheck_margin: int = 0  # rows with a vote margin below this take the second stage
    rechecked_fraction: float = 0.0  # fraction of queries that took the second stage

    def plan(self, kind: str) -> IndexParams:
        """The search parameters this trial ran with."""
        return search_plan(kind, self.value, self.recheck_value, self.recheck_margin)


def search_plan(kind: str, value: int, recheck_value: int = 0, recheck_margin: int = 0):
    """IndexParams searching a ``kind`` index with nprobe / efSearch = value, and rows whose
    vote margin is below recheck_margin again with recheck_value (0: one stage)."""
    name = SEARCH_PARAMETER[kind][0]
    return IndexParams(
        kind=kind,
        **{name: value},
        recheck_margin=recheck_margin,
        **{f"recheck_{name}": recheck_value},
    )


@dataclass(frozen=True)
class Answers:
    predicted: np.ndarray  # (V,) class indices
    indices: np.ndarray  # (V, k) reference rows
    microseconds_per_query: float
    rechecked_rows: int = 0


def answer_queries(
    index: faiss.Index,
    references: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    queries: np.ndarray,
    k: int,
    rule: str,
    plan: IndexParams | None = None,
) -> Answers:
    """Predictions for queries (V, d) through ``search_with_recheck``, timed. ``plan``: the
    search parameters (applied to the index first); None searches the index as it is."""
    if plan is not None:
        configure(index, plan)
    plan = plan or IndexParams()
    predicted, indices, rechecked = [], [], 0
    started = time.perf_counter()
    for start in range(0, len(queries), BATCH_ROWS):
        batch = queries[start : start + BATCH_ROWS]
        result = search_with_recheck(
            index, references, labels, n_classes, batch, k, plan, threads=1
        )
        indices.append(result.indices)
        predicted.append(decide(labels[result.indices], result.distances, n_classes, rule)[0])
        rechecked += result.rechecked_rows
    seconds = time.perf_counter() - started
    return Answers(
        np.concatenate(predicted),
        np.concatenate(indices),
        1e6 * seconds / max(1, len(queries)),
        rechecked,
    )


def agreement_lower_bound(agreeing: int, n: int, confidence: float) -> float:
    """One-sided Wilson score lower bound of a proportion agreeing / n at ``confidence``.

    With p = agreeing / n and z the standard normal quantile of ``confidence``:
    (p + z^2 / 2n - z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n). Unlike the normal
    approximation it stays informative at p = 1 (n / (n + z^2)). confidence 0: p itself.
    """
    if n <= 0:
        return 0.0
    p = agreeing / n
    if confidence <= 0:
        return p
    z = NormalDist().inv_cdf(confidence)
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n))


def recall_at_k(approximate: np.ndarray, exact: np.ndarray) -> float:
    """Mean over rows of |approximate row & exact row| / k; both (V, k) reference rows."""
    k = exact.shape[1]
    hits = (approximate[:, :, None] == exact[:, None, :]).any(axis=2).sum(axis=1)
    return float(hits.mean() / k)


def tune(
    index: faiss.Index,
    kind: str,
    references: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    queries: np.ndarray,
    query_labels: np.ndarray,
    *,
    k: int,
    rule: str,
    target: float,
    confidence: float = DEFAULT_CONFIDENCE,
) -> tuple[Trial | None, list[Trial], Trial]:
    """(the fastest setting or plan reaching ``target`` agreement or None, every trial, exact).

    references (N, d), labels (N,) class indices, queries (V, d), query_labels (V,). A trial
    reaches the target when ``agreement_lower_bound`` at ``confidence`` does.

    1. One-stage settings from the cheapest up, until SETTINGS_PAST_TARGET past the first
       that reaches the target (wider ones serve as second stages).
    2. Two-stage plans (v1, v2 > v1, m) scored from those runs without searching again: a
       row whose vote margin at v1 is below m takes its v2 answer. Estimated cost: us(v1) +
       (fraction rechecked) us(v2).
    3. The PLANS_MEASURED plans estimated cheapest that reach the target are run for real;
       the fastest measured trial reaching the target wins.
    """
    best_possible = _checked_target(len(queries), target, confidence)
    exact_index = build_index(references, IndexParams(kind="flat"))
    exact = answer_queries(exact_index, references, labels, n_classes, queries, k, rule)
    exact_trial = Trial(
        0,
        1.0,
        float(np.mean(exact.predicted == query_labels)),
        1.0,
        exact.microseconds_per_query,
        agreement_bound=best_possible,
    )

    def run(plan: IndexParams) -> Answers:
        return answer_queries(index, references, labels, n_classes, queries, k, rule, plan)

    def judged(found: Answers, **plan) -> Trial:
        return _judged(found, exact, query_labels, confidence, **plan)

    trials, runs = _one_stage_trials(index, kind, run, judged, target)
    estimates = estimate_two_stage_plans(
        runs, [t.value for t in trials], exact, labels, n_classes, k, target, confidence
    )
    for _, v1, v2, m in sorted(estimates)[:PLANS_MEASURED]:
        found = run(search_plan(kind, v1, v2, m))
        trials.append(judged(found, value=v1, recheck_value=v2, recheck_margin=m))
    reaching = [t for t in trials if t.agreement_bound >= target]
    chosen = min(reaching, key=lambda t: t.microseconds_per_query) if reaching else None
    return chosen, trials, exact_trial


def _checked_target(n: int, target: float, confidence: float) -> float:
    """The best agreement bound n queries can show; TuningError when it cannot reach the
    target (or the target or confidence is out of range)."""
    if not 0 < target <= 1:
        raise TuningError(f"the agreement target must lie in (0, 1], got {target}")
    if not 0 <= confidence < 1:
        raise TuningError(f"the confidence must lie in [0, 1), got {confidence}")
    best_possible = agreement_lower_bound(n, n, confidence)
    if best_possible < target:
        raise TuningError(
            f"{n} validation queries cannot show label agreement {target} at confidence "
            f"{confidence}: even full agreement bounds it at {best_possible:.4f}; use a larger "
            "validation split, a lower target or a lower confidence"
        )
    return best_possible


def _judged(found: Answers, exact: Answers, query_labels, confidence: float, **plan) -> Trial:
    """A trial: ``found``'s agreement with exact search (and its lower bound), accuracy,
    recall@k and cost."""
    n = len(query_labels)
    agreeing = int(np.sum(found.predicted == exact.predicted))
    return Trial(
        label_agreement=agreeing / n,
        agreement_bound=agreement_lower_bound(agreeing, n, confidence),
        accuracy=float(np.mean(found.predicted == query_labels)),
        recall_at_k=recall_at_k(found.indices, exact.indices),
        microseconds_per_query=found.microseconds_per_query,
        rechecked_fraction=found.rechecked_rows / max(1, n),
        **plan,
    )


def _one_stage_trials(index, kind: str, run, judged, target: float):
    """(trials, answers) of one-stage settings from the cheapest up, until
    SETTINGS_PAST_TARGET past the first that reaches the target, or full agreement."""
    trials: list[Trial] = []
    runs: list[Answers] = []
    past_target = 0
    for value in SEARCH_PARAMETER[kind][1]:
        if kind in IVF_KINDS and value > index.nlist:
            break
        found = run(search_plan(kind, value))
        trials.append(judged(found, value=value))
        runs.append(found)
        if trials[-1].agreement_bound >= target:
            past_target += 1
        if past_target > SETTINGS_PAST_TARGET or trials[-1].label_agreement == 1.0:
            break
    return trials, runs


def estimate_two_stage_plans(
    runs: list[Answers],
    values: list[int],
    exact: Answers,
    labels: np.ndarray,
    n_classes: int,
    k: int,
    target: float,
    confidence: float,
) -> list[tuple[float, int, int, int]]:
    """(estimated us/query, v1, v2, m) of every plan (v1 < v2 from the one-stage runs, margin
    1 <= m <= k) whose agreement, computed from those runs, reaches the target: a row whose
    vote margin at v1 is below m takes its v2 answer. Cost: us(v1) + (share rechecked) us(v2).
    """
    n = len(exact.predicted)
    estimates = []
    for i, first in enumerate(runs):
        margins = vote_margin(labels[first.indices], n_classes)  # (V,)
        for j in range(i + 1, len(runs)):
            second = runs[j]
            for m in range(1, k + 1):
                close = margins < m
                predicted = np.where(close, second.predicted, first.predicted)
                agreeing = int(np.sum(predicted == exact.predicted))
                if agreement_lower_bound(agreeing, n, confidence) < target:
                    continue
                cost = first.microseconds_per_query + close.mean() * second.microseconds_per_query
                estimates.append((cost, values[i], values[j], m))
    return estimates


def validation_split(artifact: Artifact) -> tuple[np.ndarray, np.ndarray]:
    if artifact.validation_embeddings is None or len(artifact.validation_embeddings) == 0:
        raise TuningError(
            f"{artifact.path}: the artifact has no validation split to tune on (it was written "
            "before validation splits were stored, or with val_size=0); retrain it with "
            "`python -m training`, or serve it with the exact flat index"
        )
    return (
        np.ascontiguousarray(artifact.validation_embeddings, dtype=np.float32),
        np.asarray(artifact.validation_labels, dtype=np.int64),
    )


def trials_table(name: str, exact: Trial, trials: list[Trial]) -> list[str]:
    """The tuning table, one line per setting tried (exact search first)."""
    lines = [
        f"{name:>10} {'recheck':>16} {'agreement':>10} {'bound':>7} {'accuracy':>9} "
        f"{'recall@k':>9} {'us/query':>9}",
        f"{'exact':>10} {'':>16} {1.0:10.4f} {exact.agreement_bound:7.4f} {exact.accuracy:9.4f} "
        f"{1.0:9.4f} {exact.microseconds_per_query:9.1f}",
    ]
    for t in trials:
        recheck = (
            f"{t.recheck_value} if m<{t.recheck_margin} ({t.rechecked_fraction:.0%})"
            if t.recheck_margin
            else ""
        )
        lines.append(
            f"{t.value:10d} {recheck:>16} {t.label_agreement:10.4f} {t.agreement_bound:7.4f} "
            f"{t.accuracy:9.4f} {t.recall_at_k:9.4f} {t.microseconds_per_query:9.1f}"
        )
    return lines


def index_record(
    index: faiss.Index,
    params: IndexParams,
    chosen: Trial,
    exact: Trial,
    trials: list[Trial],
    *,
    tuning: dict,
    build_seconds: float,
) -> dict:
    """The manifest's ``index`` record: kind, build and search parameters (what the service
    reads back, see ``service.engine.index_params``), and how they were chosen."""
    kind = params.kind
    name = SEARCH_PARAMETER[kind][0]
    build = {
        "ivf": {"nlist": int(getattr(index, "nlist", 0))},
        "ivfpq": {"nlist": int(getattr(index, "nlist", 0)), "pq_m": params.pq_m},
        "hnsw": {"hnsw_m": params.hnsw_m, "ef_construction": params.ef_construction},
    }[kind]
    recheck = (
        {f"recheck_{name}": chosen.recheck_value, "recheck_margin": chosen.recheck_margin}
        if chosen.recheck_margin
        else {}
    )
    return {
        "kind": kind,
        "params": {**build, name: chosen.value, **recheck},
        "tuning": {
            **tuning,
            "chosen": asdict(chosen),
            "exact": asdict(exact),
            "accuracy_delta": chosen.accuracy - exact.accuracy,
            "trials": [asdict(t) for t in trials],
        },
        "build_seconds": build_seconds,
    }


def index_artifact(
    path: str | Path,
    kind: str,
    *,
    target: float = DEFAULT_AGREEMENT,
    confidence: float = DEFAULT_CONFIDENCE,
    nlist: int = 0,
    hnsw_m: int = 32,
    ef_construction: int = 80,
    pq_m: int = 8,
    out: str | Path | None = None,
    log=print,
) -> dict:
    """Build a ``kind`` index for the artifact at ``path``, tune it, and write the artifact
    with it to ``out`` (default: in place). Returns the manifest's ``index`` record."""
    if kind not in SEARCH_PARAMETER:
        raise TuningError(f"--index must be one of {sorted(SEARCH_PARAMETER)}, got {kind!r}")
    # in place through a link (a published "current"): the directory it points at
    target_path = Path(out) if out is not None else Path(path).resolve()
    option = "--out" if out is not None else "the artifact"
    # writers of the target take turns; in place, this one reads the latest version in its turn
    with OutputClaim(target_path, option).turn(source=path):
        return _index_artifact(
            path, target_path, kind, target, confidence, nlist, hnsw_m, ef_construction, pq_m, log
        )


def _index_artifact(
    path, target_path, kind, target, confidence, nlist, hnsw_m, ef_construction, pq_m, log
) -> dict:
    artifact = read_artifact(path)
    queries, query_labels = validation_split(artifact)
    references = np.ascontiguousarray(artifact.embeddings, dtype=np.float32)
    labels = np.asarray(artifact.labels, dtype=np.int64)
    k, rule = artifact.default_k, artifact.decision_rule
    params = IndexParams(
        kind=kind, ivf_nlist=nlist, hnsw_m=hnsw_m, ef_construction=ef_construction, pq_m=pq_m
    )
    started = time.perf_counter()
    index = build_index(references, params)
    build_seconds = time.perf_counter() - started
    chosen, trials, exact = tune(
        index,
        kind,
        references,
        labels,
        len(artifact.classes),
        queries,
        query_labels,
        k=k,
        rule=rule,
        target=target,
        confidence=confidence,
    )
    name = SEARCH_PARAMETER[kind][0]
    log(
        f"{kind} over {len(references)} references, {len(queries)} validation queries, "
        f"k={k}, rule={rule}; built in {build_seconds:.2f} s"
    )
    for line in trials_table(name, exact, trials):
        log(line)
    if chosen is None:
        raise _nothing_reaches(kind, trials, target, confidence)
    configure(index, chosen.plan(kind))
    tuning = {"target_label_agreement": target, "confidence": confidence, "k": k, "rule": rule}
    tuning["queries"] = f"validation split ({len(queries)} rows)"
    record = index_record(
        index, params, chosen, exact, trials, tuning=tuning, build_seconds=build_seconds
    )
    index_bytes = faiss.serialize_index(index).tobytes()
    rewrite_artifact(artifact, target_path, index_bytes=index_bytes, metadata={"index": record})
    log(
        f"chose {_plan_text(name, chosen)}: agreement {chosen.label_agreement:.4f}, accuracy "
        f"{chosen.accuracy:.4f} ({chosen.accuracy - exact.accuracy:+.4f}); wrote "
        f"{target_path}/index.faiss ({len(index_bytes)} bytes)"
    )
    return record


def _nothing_reaches(kind: str, trials: list[Trial], target: float, confidence: float):
    name = SEARCH_PARAMETER[kind][0]
    best = max(trials, key=lambda t: t.label_agreement)
    return TuningError(
        f"no {name} (one or two stages) reaches label agreement {target} (lower bound at "
        f"confidence {confidence}) with this {kind} index (best "
        f"{best.label_agreement:.4f} at {name}={best.value}); use more lists or a larger "
        "HNSW degree, a lower target, or the exact flat index"
    )


def _plan_text(name: str, chosen: Trial) -> str:
    if not chosen.recheck_margin:
        return f"{name}={chosen.value}"
    return (
        f"{name}={chosen.value}, then {name}={chosen.recheck_value} for rows with a vote margin "
        f"below {chosen.recheck_margin}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.search.tuning",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("artifact", help="artifact directory")
    parser.add_argument("--index", required=True, choices=sorted(SEARCH_PARAMETER))
    parser.add_argument(
        "--agreement",
        type=float,
        default=DEFAULT_AGREEMENT,
        help="label agreement with exact search to reach (default %(default)s)",
    )
    parser.add_argument(
        "--confidence",
        type=float,
        default=DEFAULT_CONFIDENCE,
        help="the agreement's lower confidence bound must reach the target (0: the observed "
        "agreement must; default %(default)s)",
    )
    parser.add_argument("--nlist", type=int, default=0, help="IVF lists (0: about 4 sqrt(N))")
    parser.add_argument("--hnsw-m", type=int, default=32, help="HNSW graph degree")
    parser.add_argument("--ef-construction", type=int, default=80, help="HNSW build beam")
    parser.add_argument("--pq-m", type=int, default=8, help="IVF-PQ sub-quantisers")
    parser.add_argument("--out", help="write the indexed artifact here (default: in place)")
    args = parser.parse_args(argv)
    try:
        index_artifact(
            args.artifact,
            args.index,
            target=args.agreement,
            confidence=args.confidence,
            nlist=args.nlist,
            hnsw_m=args.hnsw_m,
            ef_construction=args.ef_construction,
            pq_m=args.pq_m,
            out=args.out,
        )
    except (TuningError, ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a read-only or full disk: the path and the cause, one line
        where = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
        print(f"error: {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
