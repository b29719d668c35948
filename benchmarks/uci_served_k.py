"""k chosen for unseen rows on real UCI sets: the job with its defaults (the served k and vote
chosen on its validation split, ``--decision-rule auto``) on UCI's Satellite, letters and
Shuttle, each with UCI's own test rows, and what the served pair scores on them beside the
best k on test (the same vote) and 5-NN.

Reads the sets that ``benchmarks/prepare_uci.py`` writes (a set not prepared is skipped).
The regret is the best test accuracy over k minus the served one, in points: what choosing k
on validation cost on unseen rows. ``nearest_reference_distance.ratio`` (validation rows'
median distance to their nearest reference over the test rows') says whether the
validation rows are as far from the references as test rows (near 1) or near-copies.

Each set runs once per ``--k-folds`` setting given, side by side: ``0`` chooses the served
(rule, k) on the validation split, ``auto`` (the default) cross-fits 5 maps on the
training and validation rows where the validation split is small
(``training.evaluation.cross_fit``), a number forces that many folds. The regret is
measured against the best (rule, k) on the test rows over every rule, from the artifact's
map and references (the test curve of each rule), so a choice of vote counts too. Where
the job chose a soft vote at a temperature t, the artifact's map carries it (times
sqrt(t)): its "soft" curve is then the soft vote at that t (``benchmarks/soft_scale.py``
scores every t on the fitted map).
(The leave-one-out and pooled curves this script measured before the cross-fit are in
``results/uci_served_k.json`` and in git history.)

``--sets mnist`` adds the real MNIST digits (``../shared/data/mnist.npz``: 60,000 training,
10,000 test), skipped when absent.

Usage: python benchmarks/uci_served_k.py [--sets satellite,letters,shuttle,mnist]
    [--k-folds 0,auto] [--seeds 0] [--name uci_served_k_cross_fit]
Writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import letters, satellite, shuttle
from harness.report import machine, print_table, save_json

MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist.npz"


def uci_sets(names: list[str]):
    """name -> (X_train, y_train, X_test, y_test) for each prepared set."""
    for name in names:
        if name == "mnist":
            found = None
            if MNIST.exists():
                with np.load(MNIST) as d:
                    found = (d["X"], d["y"], d["X_test"], d["y_test"])
        elif name == "letters":
            split = letters(n_validation=0)
            found = None if split is None else (split[0], split[1], split[4], split[5])
        else:
            found = {"satellite": satellite, "shuttle": shuttle}[name]()
        if found is None:
            print(f"{name}: not prepared (benchmarks/prepare_uci.py), skipped")
            continue
        yield name, found


def test_curves(model: Path, X_test: np.ndarray, y_test: np.ndarray) -> dict[str, dict[int, float]]:
    """{rule: {k: test accuracy}} of the artifact's map and references, for every rule."""
    from service.core.artifact import read_artifact
    from service.core.knn import project
    from service.core.vocabulary import NEIGHBOUR_RULES
    from training.evaluation.evaluate import K_VALUES, knn_accuracies_by_rule

    artifact = read_artifact(model)
    z_test = project(np.asarray(X_test), artifact.projection, artifact.offset)  # (n, d)
    classes = list(artifact.classes)
    y_idx = np.array([classes.index(v) for v in np.asarray(y_test).tolist()])
    return knn_accuracies_by_rule(
        np.asarray(artifact.embeddings),
        np.asarray(artifact.labels),
        z_test,
        y_idx,
        len(classes),
        K_VALUES,
        NEIGHBOUR_RULES,
    )


@contextlib.contextmanager
def job_artifact(name, X, y, X_test, y_test, k_folds: str, seed: int):
    """The job with its defaults on one set (written as an .npz with its own test rows),
    with ``--k-folds`` and ``--seed``, in a temporary folder: yields (the artifact's path,
    the job's seconds); the folder goes when the block ends."""
    from training.config import TrainConfig
    from training.job import run

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / f"{name}.npz"
        np.savez(data, X=X, y=y, X_test=X_test, y_test=y_test)
        out = Path(tmp) / "model"
        started = time.perf_counter()
        config = TrainConfig(
            data=str(data), out=str(out), plots=False, quiet=True, k_folds=k_folds, seed=seed
        )
        run(config, log=lambda *_: None)
        yield out, time.perf_counter() - started


def one_run(name, X, y, X_test, y_test, k_folds: str, seed: int) -> dict:
    """The job on one set with one --k-folds and --seed: what it served, against the best."""
    with job_artifact(name, X, y, X_test, y_test, k_folds, seed) as (out, seconds):
        metrics = json.loads((out / "report.json").read_text())["metrics"]
        curves = test_curves(out, X_test, y_test)
    served_rule, served_k = metrics.get("decision_rule", "majority"), metrics["default_k"]
    best_rule, best_k = max(
        ((r, k) for r in curves for k in curves[r]), key=lambda rk: (curves[rk[0]][rk[1]], -rk[1])
    )
    choice = metrics["k_choice"]
    return {
        "set": name,
        "seed": seed,
        "k_folds": k_folds,
        "chosen_on": choice["method"],
        "choice_rows": choice["rows"],
        "n_train": len(y),
        "n_test": len(y_test),
        # the vote served ("soft@0.5": its "soft" curve above is on the map that carries t)
        "served": f"{metrics.get('vote', served_rule)} {served_k}",
        "test_at_served": curves[served_rule][served_k],
        "best_on_test": f"{best_rule} {best_k}",
        "test_at_best": curves[best_rule][best_k],
        "regret_points": 100 * (curves[best_rule][best_k] - curves[served_rule][served_k]),
        "majority_5": curves["majority"].get(5),
        "distance_ratio": (metrics.get("nearest_reference_distance") or {}).get("ratio"),
        "choice_curve": choice.get("accuracy") or metrics.get("val_accuracy_by_rule"),
        "test_curves": curves,
        "job_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="satellite,letters,shuttle,mnist")
    parser.add_argument("--k-folds", default="0,auto", help="--k-folds settings, side by side")
    parser.add_argument("--seeds", default="0", help="the job's --seed (its split too)")
    parser.add_argument("--name", default="uci_served_k_cross_fit")
    args = parser.parse_args()
    rows = []
    for name, (X, y, X_test, y_test) in uci_sets(args.sets.split(",")):
        for seed in [int(s) for s in args.seeds.split(",")]:
            for k_folds in args.k_folds.split(","):
                rows.append(one_run(name, X, y, X_test, y_test, k_folds, seed))
                print({k: v for k, v in rows[-1].items() if not k.endswith("curves")}, flush=True)
    columns = ["set", "seed", "k_folds", "chosen_on", "choice_rows", "served", "test_at_served"]
    columns += ["best_on_test", "test_at_best", "regret_points", "majority_5", "job_seconds"]
    print_table(rows, columns)
    save_json(f"{args.name}.json", {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
