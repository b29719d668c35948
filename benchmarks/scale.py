"""How the default fit's cost grows with N: fit seconds by phase, peak RSS and accuracy.

Fits ``NCA(n_components=32, random_state=0)`` (the estimator's defaults) on samples of one
synthetic distribution (``training.data.synthetic.clustered_classes``: 20 classes of 4
Gaussian clusters in a 24-dimensional subspace of D features, overlap 0.75, noise 0.55; the
setting on which the default was measured against Euclidean kNN in issue 44) at each N, and
scores 1-NN and 5-NN on ``--test`` held-out rows of the same distribution, beside Euclidean
kNN on the raw features and PCA to d = 32.

Each (N, D) runs in a process of its own, alone, so its peak RSS (``ru_maxrss``) is its own;
the training rows are generated into that process (float32, N x D x 4 bytes). The exponent
between two sizes is log(t2 / t1) / log(N2 / N1) of the fit seconds.

``--family moving`` draws ``MOVING`` instead: moving neighbourhoods (many interleaved
clusters per class and a style shared across classes that decides the raw neighbours; see
``clustered_classes``), where the map changes which points are near, and each refresh's
share of changed candidate sets is printed.

Usage: taskset -c 0,1 python benchmarks/scale.py [--sizes 60000,250000,1000000] [--features 128]
                                                  [--test 5000] [--family clustered|moving]
Writes benchmarks/results/scale.json (rows of sizes not run this time are kept) and
scale.png (fit seconds against N, log-log).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.phases import PhaseClock
from harness.report import RESULTS, gemm_gflops, machine, peak_rss_mib, print_table, save_json

DISTRIBUTION = dict(n_classes=20, clusters_per_class=4, subspace_dim=24, overlap=0.75, noise=0.55)
# moving neighbourhoods: 32 interleaved clusters per class in a 16-dimensional subspace, and
# one of 64 styles (an 8-dimensional nuisance shared across classes, 2.5 times the centres'
# spread) that decides the raw nearest neighbours: Euclidean 5-NN 0.25, a learned map 0.86
# at 20,000 rows; the map moves every neighbourhood
MOVING = dict(
    n_classes=20,
    clusters_per_class=32,
    subspace_dim=16,
    overlap=0.55,
    noise=0.3,
    nuisance_dim=8,
    nuisance_clusters=64,
    nuisance_scale=2.5,
)
FAMILIES = {"clustered": DISTRIBUTION, "moving": MOVING}
N_COMPONENTS = 32


def one_run(n: int, n_features: int, n_test: int, family: str = "clustered") -> dict:
    """The fit and its scores at one size, in this process."""
    from sklearn.decomposition import PCA

    from training import NCA
    from training.data.synthetic import clustered_classes
    from training.evaluation.evaluate import knn_accuracies

    law = FAMILIES[family]
    X, y = clustered_classes(n, n_features=n_features, sample_seed=1, **law)
    Xt, yt = clustered_classes(n_test, n_features=n_features, sample_seed=2, **law)
    n_classes = law["n_classes"]
    with PhaseClock() as clock, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        started = time.perf_counter()
        model = NCA(n_components=N_COMPONENTS, random_state=0).fit(X, y)
        fit_s = time.perf_counter() - started
    fit_rss = peak_rss_mib()
    history = model.history_
    first = [r for r in history if r.get("stage") != "exact finish"]
    finish = [r for r in history if r.get("stage") == "exact finish"]
    candidate_s = first[-1]["seconds"] if first else 0.0
    learned = knn_accuracies(model.transform(X), y, model.transform(Xt), yt, n_classes, (1, 5))
    raw = knn_accuracies(X, y, Xt, yt, n_classes, (1, 5))
    pca = PCA(N_COMPONENTS, random_state=0).fit(X[: min(n, 200_000)])
    projected = knn_accuracies(pca.transform(X), y, pca.transform(Xt), yt, n_classes, (1, 5))
    return {
        "family": family,
        "n": n,
        "features": n_features,
        "fit_s": fit_s,
        "prepare_s": clock.prepare_s,
        "candidate_stage_s": candidate_s - clock.prepare_s,
        "refreshes": len(clock.refresh_s),
        "refresh_s": sum(clock.refresh_s),
        "finish_s": (finish[-1]["seconds"] - candidate_s) if finish else 0.0,
        "exact_evaluations": len(clock.exact_s),
        "stages": model.stages_,
        "n_iter": model.n_iter_,
        "peak_rss_mib": fit_rss,
        "data_mib": X.nbytes / 2**20,
        "acc_1nn": learned[1],
        "acc_5nn": learned[5],
        "euclidean_1nn": raw[1],
        "euclidean_5nn": raw[5],
        "pca_1nn": projected[1],
        "pca_5nn": projected[5],
    }


def exponents(rows: list[dict]) -> list[dict]:
    """The growth exponent of the fit seconds between consecutive sizes of one D."""
    out = []
    for a, b in itertools.pairwise(rows):
        if (a["family"], a["features"]) == (b["family"], b["features"]):
            exponent = math.log(b["fit_s"] / a["fit_s"]) / math.log(b["n"] / a["n"])
            out.append(
                {
                    "family": a["family"],
                    "features": a["features"],
                    "from": a["n"],
                    "to": b["n"],
                    "exponent": exponent,
                }
            )
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for family, features in sorted({(r["family"], r["features"]) for r in rows}):
        mine = [r for r in rows if (r["family"], r["features"]) == (family, features)]
        ns = [r["n"] for r in mine]
        ax.loglog(ns, [r["fit_s"] for r in mine], "o-", label=f"fit, {family} D = {features}")
        ax.loglog(
            ns, [r["refresh_s"] for r in mine], "s--", label=f"refreshes, {family} D = {features}"
        )
        ax.loglog(ns, [mine[0]["fit_s"] * n / ns[0] for n in ns], ":", color="grey")
    ax.set_xlabel("training rows N")
    ax.set_ylabel("seconds (2 cores)")
    ax.set_title("Default NCA fit, d = 32 (dotted: linear in N)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="60000,250000,1000000")
    parser.add_argument("--features", default="128")
    parser.add_argument("--test", type=int, default=5000)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="clustered")
    parser.add_argument("--one", nargs=2, type=int, metavar=("N", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(*args.one, args.test, args.family)))
        return
    rows = []
    for features in (int(f) for f in args.features.split(",")):
        for n in (int(s) for s in args.sizes.split(",")):
            command = [
                sys.executable,
                __file__,
                "--one",
                str(n),
                str(features),
                "--test",
                str(args.test),
                "--family",
                args.family,
            ]
            gemm = gemm_gflops()  # the machine's rate just before the run
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append({**json.loads(done.stdout.strip().splitlines()[-1]), "gemm_gflops": gemm})
            print(rows[-1], flush=True)
    previous = RESULTS / "scale.json"
    if previous.exists():  # rows of sizes not run this time are kept
        ran = {(r["family"], r["n"], r["features"]) for r in rows}
        kept = [
            {"family": "clustered", **r}
            for r in json.loads(previous.read_text())["rows"]
            if (r.get("family", "clustered"), r["n"], r["features"]) not in ran
        ]
        rows = sorted(kept + rows, key=lambda r: (r["family"], r["features"], r["n"]))
    columns = ["family", "n", "features", "fit_s", "prepare_s", "candidate_stage_s", "refreshes"]
    columns += ["refresh_s", "finish_s", "exact_evaluations", "peak_rss_mib"]
    columns += ["acc_1nn", "acc_5nn", "euclidean_5nn", "pca_5nn", "gemm_gflops"]
    print_table(rows, columns)
    for r in rows:  # how far the map moved the neighbourhoods: sets changed per refresh
        for stage in r.get("stages") or []:
            if stage.get("refresh_changes"):
                changes = ", ".join(f"{c:.2f}" for c in stage["refresh_changes"])
                replaced = ", ".join(f"{c:.2f}" for c in stage.get("refresh_replaced", []))
                print(
                    f"{r['family']} N = {r['n']}: {stage['stage']} refreshes changed the sets "
                    f"of {changes} of the points, replacing {replaced} of the candidates"
                )
    growth = exponents(rows)
    for g in growth:
        print(
            f"{g['family']} D = {g['features']}: exponent {g['exponent']:.2f} from {g['from']} to {g['to']} rows"
        )
    save_json("scale.json", {"machine": machine(), "rows": rows, "exponents": growth})
    plot(rows, RESULTS / "scale.png")


if __name__ == "__main__":
    main()
