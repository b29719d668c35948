"""k chosen for unseen rows on real UCI sets: the job with its defaults (the served k and vote
chosen on its validation split, ``--decision-rule auto``) on UCI's Satellite, letters and
Shuttle, each with UCI's own test rows, and what the served pair scores on them beside the
best k on test (the same vote) and 5-NN.

Reads the sets that ``benchmarks/prepare_uci.py`` writes (a set not prepared is skipped).
The regret is the best test accuracy over k minus the served one, in points: what choosing k
on validation cost on unseen rows. ``nearest_reference_distance.ratio`` (validation rows'
median distance to their nearest reference over the test rows') says whether the
validation rows are as far from the references as test rows (near 1) or near-copies.

Beside the job's validation curve, the leave-one-out curve over the references themselves
(each reference's k nearest other references vote, majority rule, in the learned space):
ten times the rows of the validation split, but rows the map was fitted to. It is measured
here, not used by the job: which k it would have chosen, and that choice's test accuracy;
and the pooled choice, the k with the most right votes over the validation rows and the
references together (validation's counts plus leave-one-out's).

``--sets mnist`` adds the real MNIST digits (``../shared/data/mnist.npz``: 60,000 training,
10,000 test), skipped when absent.

Usage: python benchmarks/uci_served_k.py [--sets satellite,letters,shuttle,mnist]
Writes benchmarks/results/uci_served_k.json.
"""

from __future__ import annotations

import argparse
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


def leave_one_out_curve(model: Path, ks: list[int]) -> dict[int, float]:
    """{k: the majority vote's accuracy over the artifact's references, each voted on by its
    k nearest other references}, in the learned space."""
    from service.core.artifact import read_artifact
    from service.core.knn import decide, exact_knn

    artifact = read_artifact(model)
    z = np.asarray(artifact.embeddings)  # (N, d)
    labels = np.asarray(artifact.labels)  # (N,) class indices
    distances, indices = exact_knn(z, z, max(ks) + 1)  # (N, k + 1)
    # drop each row's own entry (not always the first: an exact duplicate ties with it),
    # or the farthest where duplicates crowded it out
    own = indices == np.arange(len(z))[:, None]
    own[~own.any(axis=1), -1] = True
    distances = distances[~own].reshape(len(z), max(ks))
    indices = indices[~own].reshape(len(z), max(ks))
    n_classes = len(artifact.classes)
    curve = {}
    for k in sorted(ks):
        predicted, _ = decide(labels[indices[:, :k]], distances[:, :k], n_classes, "majority")
        curve[k] = float((predicted == labels).mean())
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="satellite,letters,shuttle,mnist")
    args = parser.parse_args()
    from training.config import TrainConfig
    from training.job import run

    rows = []
    for name, (X, y, X_test, y_test) in uci_sets(args.sets.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / f"{name}.npz"
            np.savez(data, X=X, y=y, X_test=X_test, y_test=y_test)
            out = Path(tmp) / "model"
            started = time.perf_counter()
            run(
                TrainConfig(data=str(data), out=str(out), plots=False, quiet=True),
                log=lambda *_: None,
            )
            seconds = time.perf_counter() - started
            metrics = json.loads((out / "report.json").read_text())["metrics"]
            loo = leave_one_out_curve(out, [int(k) for k in metrics["test_accuracy"]])
            n_references = len(np.load(out / "labels.npy"))
        test = {int(k): v for k, v in metrics["test_accuracy"].items()}
        served = metrics["default_k"]
        best_k = max(test, key=lambda k: (test[k], -k))
        distance = metrics.get("nearest_reference_distance") or {}
        n_val = len(y) - n_references
        pooled = {  # right votes over validation rows and references, as a fraction
            k: (n_val * metrics["val_accuracy"][str(k)] + n_references * loo[k])
            / (n_val + n_references)
            for k in loo
        }
        rows.append(
            {
                "set": name,
                "n_train": len(y),
                "n_test": len(y_test),
                "served_k": served,
                "rule": metrics.get("decision_rule", "majority"),
                "val_at_served": metrics["val_accuracy_at_default_k"],
                "test_at_served": test[served],
                "test_at_5": test.get(5),
                "best_test_k": best_k,
                "test_at_best": test[best_k],
                "regret_points": 100 * (test[best_k] - test[served]),
                "distance_ratio": distance.get("ratio"),
                "loo_k": (loo_k := max(loo, key=lambda k: (loo[k], -k))),
                "test_at_loo_k": test.get(loo_k),
                "pooled_k": (pooled_k := max(pooled, key=lambda k: (pooled[k], -k))),
                "test_at_pooled_k": test.get(pooled_k),
                "regret_pooled_points": 100 * (test[best_k] - test[pooled_k]),
                "loo_curve": loo,
                "val_curve": metrics["val_accuracy"],
                "test_curve": metrics["test_accuracy"],
                "job_seconds": seconds,
            }
        )
        print(rows[-1], flush=True)
    columns = ["set", "served_k", "rule", "test_at_served", "test_at_5", "best_test_k"]
    columns += ["test_at_best", "regret_points", "distance_ratio", "loo_k", "test_at_loo_k"]
    print_table(rows, [*columns, "pooled_k", "regret_pooled_points"])
    save_json("uci_served_k.json", {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
