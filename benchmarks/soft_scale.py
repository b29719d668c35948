"""The soft vote at a temperature: would the job serve unseen rows better if its soft vote
weighed the k neighbours at a fraction t of the map's own squared scale?

The served soft vote is NCA's rule restricted to the k nearest references,
P(c) proportional to sum_{j in kNN, y_j = c} exp(-t ||z - z_j||^2), at t = 1: the map's scale,
which NCA's objective calibrates on the training rows. On the real digits the job's
validation split chose that vote over the majority vote while the test rows preferred the
majority vote (``results/round6_digits_cross_fit.json``); a smaller t flattens the weights
toward the majority vote. t is the same as serving the map multiplied by sqrt(t).

For each set and seed the job runs with its defaults (``--k-folds 0``: the validation
split chooses), and from its artifact (references = the training split; the validation
rows the artifact keeps; the map divided by the report's ``map_scale``, so that t is
relative to the fitted map) this script scores the validation and test curves over k of
the majority vote and of the soft vote at t = 1 and at each t in ``--temperatures``, then
replays the job's choice (``training.evaluation.evaluate.choose_rule_and_k``: the best
(rule, k) on validation, the earlier rule among equals, the training k among equal ks)
with each candidate set of votes:

* ``majority+soft@1``: what the job served before the soft vote had a temperature;
* ``majority+soft@t``: the soft vote at t in place of t = 1;
* ``majority+soft@1+soft@t``: both offered to the choice;
* ``soft@t`` alone;
* ``job``: the votes the job offers now (``SERVED_VOTES``), whose replay must give the
  job's own served vote and k (``replay_matches_job``).

The test error of what each choice serves, per set and seed, and the regret against the
best (rule, k) on test over every rule scored. Sets: USPS and the real MNIST digits
(``../shared/data``), UCI's Satellite, letters and Shuttle (``benchmarks/prepare_uci.py``);
a set that is not there is skipped.

Usage: python benchmarks/soft_scale.py [--sets usps,satellite,letters,shuttle,mnist]
    [--seeds 0,1,2] [--temperatures 0.5,0.25] [--name soft_scale]
Writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import machine, print_table, save_json
from uci_served_k import job_artifact, uci_sets

USPS = Path(__file__).resolve().parents[2] / "shared" / "data" / "usps.npz"


def all_sets(names: list[str]):
    """name -> (X_train, y_train, X_test, y_test): USPS here, the rest from uci_served_k."""
    for name in names:
        if name == "usps":
            if not USPS.exists():
                print("usps: not found, skipped")
                continue
            with np.load(USPS) as d:
                yield name, (d["X"], d["y"], d["X_test"], d["y_test"])
        else:
            yield from uci_sets([name])


def curves_at(z_ref, y_ref, z_query, y_query, n_classes, temperatures) -> dict:
    """{rule name: {k: accuracy}}: "majority", and "soft@t" for each t (the soft vote on the
    embeddings multiplied by sqrt(t), which multiplies every squared distance by t)."""
    from training.evaluation.evaluate import K_VALUES, knn_accuracies_by_rule

    ks = tuple(k for k in K_VALUES if k <= len(z_ref))
    out = {
        "majority": knn_accuracies_by_rule(
            z_ref, y_ref, z_query, y_query, n_classes, ks, ("majority",)
        )["majority"]
    }
    for t in temperatures:
        s = np.float32(np.sqrt(t))
        soft = knn_accuracies_by_rule(
            z_ref * s, y_ref, z_query * s, y_query, n_classes, ks, ("soft",)
        )["soft"]
        out[f"soft@{t:g}"] = soft
    return out


def choices(temperatures) -> dict[str, tuple[str, ...]]:
    """The candidate sets of votes the job's choice is replayed with."""
    from training.evaluation.evaluate import SERVED_VOTES

    job = tuple(v if "@" in v or v == "majority" else f"{v}@1" for v in SERVED_VOTES)
    sets = {"majority+soft@1": ("majority", "soft@1"), "job": job}
    for t in temperatures:
        if t == 1:
            continue
        sets[f"majority+soft@{t:g}"] = ("majority", f"soft@{t:g}")
        sets[f"majority+soft@1+soft@{t:g}"] = ("majority", "soft@1", f"soft@{t:g}")
        sets[f"soft@{t:g}"] = (f"soft@{t:g}",)
    return sets


def one_run(name, X, y, X_test, y_test, seed: int, temperatures) -> dict:
    """The job on one set and seed, its artifact's curves, and each replayed choice."""
    from service.core.artifact import read_artifact
    from service.core.knn import project
    from training.config import TrainConfig
    from training.evaluation.evaluate import choose_rule_and_k, parse_vote, vote_name
    from training.model.initialization import served_map_scale

    with job_artifact(name, X, y, X_test, y_test, "0", seed) as (out, seconds):
        metrics = json.loads((out / "report.json").read_text())["metrics"]
        art = read_artifact(out)
        scale = served_map_scale(art)  # the served map over the fitted one
        classes = list(art.classes)
        # (N, d), (n_val, d), (n_test, d): in the fitted map's scale
        z_ref = np.asarray(art.embeddings, dtype=np.float32) / np.float32(scale)
        y_ref = np.asarray(art.labels, dtype=np.int64)
        z_val = np.asarray(art.validation_embeddings, dtype=np.float32) / np.float32(scale)
        y_val = np.asarray(art.validation_labels, dtype=np.int64)
        z_test = project(np.asarray(X_test), art.projection, art.offset) / np.float32(scale)
        y_test_idx = np.array([classes.index(v) for v in np.asarray(y_test).tolist()])
        served = (metrics.get("vote", art.decision_rule), int(art.default_k))
    n_classes = len(classes)
    val = curves_at(z_ref, y_ref, z_val, y_val, n_classes, [1.0, *temperatures])
    test = curves_at(z_ref, y_ref, z_test, y_test_idx, n_classes, [1.0, *temperatures])
    best = max(test[r][k] for r in test for k in test[r])
    replayed = {}
    for label, rules in choices(temperatures).items():
        rule, k = choose_rule_and_k({r: val[r] for r in rules}, TrainConfig().k)
        replayed[label] = {
            "served": f"{rule} {k}",
            "test_error": 100 * (1 - test[rule][k]),
            "regret_points": 100 * (best - test[rule][k]),
        }
    replayed_vote, replayed_k = replayed["job"]["served"].split()  # "soft@1 7": the job's "soft 7"
    replay_of_job = f"{vote_name(*parse_vote(replayed_vote))} {replayed_k}"
    return {
        "set": name,
        "seed": seed,
        "map_scale": scale,
        "n_train": len(y),
        "n_test": len(y_test),
        "job_served": f"{served[0]} {served[1]}",
        "replay_matches_job": replay_of_job == f"{served[0]} {served[1]}",
        "job_val_curve": metrics.get("val_accuracy_by_rule"),
        "best_test_error": 100 * (1 - best),
        "choices": replayed,
        "val_curves": val,
        "test_curves": test,
        "job_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="usps,satellite,letters,shuttle,mnist")
    parser.add_argument("--seeds", default="0,1,2", help="the job's --seed (its split too)")
    parser.add_argument("--temperatures", default="0.5,0.25", help="t < 1 to try beside t = 1")
    parser.add_argument("--name", default="soft_scale")
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    rows = []
    for name, (X, y, X_test, y_test) in all_sets(args.sets.split(",")):
        for seed in [int(s) for s in args.seeds.split(",")]:
            row = one_run(name, X, y, X_test, y_test, seed, temperatures)
            rows.append(row)
            flat = {c: v["test_error"] for c, v in row["choices"].items()}
            print(name, seed, row["job_served"], row["replay_matches_job"], flat, flush=True)
    table = []
    for row in rows:
        line = {"set": row["set"], "seed": row["seed"], "best": round(row["best_test_error"], 2)}
        for label, choice in row["choices"].items():
            line[label] = f"{choice['test_error']:.2f} ({choice['served']})"
        table.append(line)
    print_table(table, list(table[0]))
    save_json(
        f"{args.name}.json", {"machine": machine(), "temperatures": temperatures, "rows": rows}
    )


if __name__ == "__main__":
    main()
