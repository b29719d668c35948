"""Learned reference sets: test accuracy of the k-NN rule on a fraction of the references.

For each data set (clean, and with 25% of the training and validation labels replaced by
another class; test labels stay clean), one NCA map is fitted with the estimator's defaults,
then the references are reduced to 1%, 2%, 5% and 10% of the training rows by:

* hart: Hart's condensing (check_k = the served k + 2; it keeps what it keeps, one row);
* kmeans+glvq: per-class k-means prototypes refined by GLVQ (``--refine glvq``, since
  removed: the results file keeps its rows, which this script no longer measures);
* learned, map fixed: ``references condense --method prototypes`` (the default, NCA's f
  objective on the prototypes; ``training.references.compress``: Wilson editing first when
  validation prefers it);
* learned jointly: the joint mode (``NCA(options={"prototypes": R})`` / ``python -m training
  --prototypes R``): the prototypes and the map together from the fitted map, log loss,
  the same editing choice.

Every method's served k is chosen on the validation split (K_VALUES; prototypes fall back to
1), as the command and the job choose it. Accuracy is on the test split at that k and at
k = 1; seconds are the compression's alone.

Sets: usps (7,291 - 700 validation rows, 256 pixels, d = 32; USPS's own 2,007 test rows),
letters (UCI's letter recognition, ``harness.data.letters``: the first 16,000 rows, 1,600 of
them validation, train; the last 4,000 test; 16 features, 26 classes, d = 12; run
``benchmarks/prepare_uci.py`` once first), usps784 (``harness.data.usps_784``: 60,000
references of 784 pixels, d = 32), mnist (the real MNIST digits, ``../shared/data/mnist.npz``:
54,000 references, 6,000 validation rows, the 10,000 test rows; d = 32), letters26 (scikit-learn's make_classification: 20,000 rows, 16 features, 26 classes, two clusters
each, class_sep 3; 16,400 / 1,600 / 2,000; d = 12).

Usage: python benchmarks/learned_references.py [--sets usps,letters,usps784]
       [--noise 0,0.25] [--fractions 0.01,0.02,0.05,0.1]
Writes benchmarks/results/learned_references.json (sets not run keep their last rows).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import USPS_PATH, letters, usps_784
from harness.report import RESULTS, machine, print_table, save_json

# "kmeans+glvq" orders the rows measured before --refine glvq was removed
METHODS = ("full", "hart", "kmeans+glvq", "learned, map fixed", "learned jointly")
METHOD_KEYS = {
    "hart": "hart",
    "fixed": "learned, map fixed",
    "joint": "learned jointly",
}  # --methods' names


def split_npz(path: Path, n_validation: int):
    """(X_ref, y_ref, X_val, y_val, X_test, y_test) from an .npz with X, y, X_test, y_test:
    ``n_validation`` of the training rows drawn with seed 0 validate, the rest are the
    references; None when the file is absent."""
    if not path.exists():
        return None
    data = np.load(path)
    X, y = data["X"].astype(np.float32), data["y"].astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    val, train = order[:n_validation], order[n_validation:]
    X_test, y_test = data["X_test"].astype(np.float32), data["y_test"].astype(np.int64)
    return X[train], y[train], X[val], y[val], X_test, y_test


def usps():
    return split_npz(USPS_PATH, 700)


def letters26():
    from sklearn.datasets import make_classification

    X, y = make_classification(
        n_samples=20000,
        n_features=16,
        n_informative=14,
        n_redundant=2,
        n_classes=26,
        n_clusters_per_class=2,
        class_sep=3.0,
        random_state=0,
    )
    X = X.astype(np.float32)
    order = np.random.default_rng(0).permutation(len(y))
    test, val, train = order[:2000], order[2000:3600], order[3600:]
    return X[train], y[train], X[val], y[val], X[test], y[test]


def usps784():
    return usps_784(60000, 1000, 2007)


def mnist():
    """The real MNIST digits: 54,000 references and 6,000 validation rows drawn from the
    60,000 training rows (seed 0), the 10,000 test rows."""
    return split_npz(USPS_PATH.parent / "mnist.npz", 6000)


SETS = {
    "usps": (usps, 32),
    "letters": (letters, 12),
    "letters26": (letters26, 12),
    "usps784": (usps784, 32),
    "mnist": (mnist, 32),
}


def with_noise(y: np.ndarray, n_classes: int, fraction: float, seed: int) -> np.ndarray:
    """y with ``fraction`` of the labels replaced by another class, drawn uniformly."""
    if fraction == 0:
        return y
    rng = np.random.default_rng(seed)
    y = y.copy()
    flip = rng.random(len(y)) < fraction
    y[flip] = (y[flip] + rng.integers(1, n_classes, flip.sum())) % n_classes
    return y


def scores(refs, ref_labels, z_val, y_val, z_test, y_test, n_classes, fallback) -> dict:
    """The served k (best on validation) and test accuracy at it and at k = 1."""
    from training.evaluation.evaluate import K_VALUES, choose_k, knn_accuracies

    ks = tuple(k for k in K_VALUES if k <= len(refs))
    val = knn_accuracies(refs, ref_labels, z_val, y_val, n_classes, ks)
    k = choose_k(val, fallback=min(fallback, len(refs)))
    test = knn_accuracies(refs, ref_labels, z_test, y_test, n_classes, ks)
    return {"served_k": k, "test_at_served_k": test[k], "test_at_1": test[1]}


def fitted(name: str, noise: float, cache: str | None):
    """(data with noisy labels, the NCA map fitted with the defaults, its fit seconds), or
    None when the set's data is absent. With ``cache``, the map is pickled there by set and
    noise and read back by later runs (the fit is seeded, so the map is the same)."""
    from training import NCA

    loaded = SETS[name][0]()
    if loaded is None:
        return None
    X, y, X_val, y_val, X_test, y_test = loaded
    n_classes = int(y.max()) + 1
    y, y_val = with_noise(y, n_classes, noise, 1), with_noise(y_val, n_classes, noise, 2)
    path = Path(cache) / f"{name}-noise{noise:g}.pkl" if cache else None
    if path is not None and path.exists():
        nca, fit_seconds = pickle.loads(path.read_bytes())
    else:
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nca = NCA(n_components=SETS[name][1], random_state=0).fit(X, y)
        fit_seconds = time.perf_counter() - started
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(pickle.dumps((nca, fit_seconds)))
    return (X, y, X_val, y_val, X_test, y_test), nca, fit_seconds


def run_set(
    name: str, noise: float, fractions: list[float], save: str | None, methods, cache
) -> list[dict]:
    from training.references.compress import compress, edit_k_for
    from training.references.condense import condense

    loaded = fitted(name, noise, cache)
    if loaded is None:
        print(f"{name}: data absent, skipped")
        return []
    (X, y, X_val, y_val, X_test, y_test), nca, fit_seconds = loaded
    n_classes = int(y.max()) + 1
    z, z_val, z_test = nca.transform(X), nca.transform(X_val), nca.transform(X_test)
    xs = ((X - nca.mean_) / nca.scale_).astype(np.float32)
    xs_val = ((X_val - nca.mean_) / nca.scale_).astype(np.float32)
    common = (z_val, y_val, z_test, y_test, n_classes)
    base = {"set": name, "noise": noise, "n_train": len(y), "nca_fit_seconds": fit_seconds}
    full = scores(z, y, *common, fallback=3)
    if save and noise == 0:  # the clean model as an artifact, for compressed_serving.py
        from compressed_serving import write_model

        write_model(Path(save) / name, nca, X, y, X_val, y_val, full["served_k"])
    rows = [{**base, "fraction": 1.0, "method": "full", "references": len(y), **full}]
    print(f"{name} noise={noise}: NCA fit {fit_seconds:.1f} s; full set {full}", flush=True)

    if "hart" in methods:
        started = time.perf_counter()
        keep, _ = condense(z, y, n_classes, check_k=full["served_k"] + 2)
        seconds = time.perf_counter() - started
        hart = scores(z[keep], y[keep], *common, fallback=full["served_k"])
        rows.append(
            {
                **base,
                "fraction": float(keep.mean()),
                "method": "hart",
                "references": int(keep.sum()),
                "seconds": seconds,
                **hart,
            }
        )
    for fraction in fractions:
        reduction = 1.0 / fraction
        edit_k = edit_k_for(full["served_k"])
        ran = 0
        if "learned, map fixed" in methods:
            started = time.perf_counter()
            fixed = compress(
                z,
                y,
                reduction=reduction,
                n_classes=n_classes,
                rule="majority",
                edit_k=edit_k,
                x_val=z_val,
                y_val=y_val,
            )
            fit = fixed.fit
            rows.append(
                _row(
                    base,
                    fraction,
                    "learned, map fixed",
                    fit.prototypes,
                    fit.labels,
                    started,
                    common,
                    iterations=fit.n_iter,
                    loss=fixed.loss,
                    edited=fixed.editing["edited"],
                )
            )
            ran += 1
        if "learned jointly" in methods:
            started = time.perf_counter()
            joint = compress(
                xs,
                y,
                reduction=reduction,
                n_classes=n_classes,
                rule="majority",
                edit_k=edit_k,
                x_val=xs_val,
                y_val=y_val,
                u=z,
                projection=nca.components_,
                joint=True,
                loss="log",
            )
            fit = joint.fit
            a = fit.projection.astype(np.float32)
            z_val_j = xs_val @ a.T
            z_test_j = ((X_test - nca.mean_) / nca.scale_).astype(np.float32) @ a.T
            rows.append(
                _row(
                    base,
                    fraction,
                    "learned jointly",
                    fit.prototypes,
                    fit.labels,
                    started,
                    (z_val_j, y_val, z_test_j, y_test, n_classes),
                    iterations=fit.n_iter,
                    edited=joint.editing["edited"],
                )
            )
            ran += 1
        for row in rows[len(rows) - ran :]:
            print(
                f"  {fraction:.0%} {row['method']:20s} {row['references']:6d} refs: "
                f"test {row['test_at_served_k']:.4f} at k={row['served_k']} "
                f"({row['test_at_served_k'] - full['test_at_served_k']:+.4f}), "
                f"{row['seconds']:.1f} s, edited: {row.get('edited')}",
                flush=True,
            )
    return rows


def seed_medians(
    name: str, noise: float, fractions: list[float], seeds: int, loss: str, cache: str | None
) -> Iterator[dict]:
    """The default (map fixed) over ``seeds`` k-means seeds, one row per fraction as it is
    measured: the change from the full set's test accuracy at each seed, the median (one NCA
    map, as above), the loss each seed kept and the median seconds of a compression.
    ``loss`` is the learner's ("auto": its default)."""
    from training.references.compress import compress, edit_k_for

    (X, y, X_val, y_val, X_test, y_test), nca, _ = fitted(name, noise, cache)
    n_classes = int(y.max()) + 1
    z, z_val, z_test = nca.transform(X), nca.transform(X_val), nca.transform(X_test)
    common = (z_val, y_val, z_test, y_test, n_classes)
    full = scores(z, y, *common, fallback=3)
    for fraction in fractions:
        changes, kept, seconds = [], [], []
        for seed in range(seeds):
            started = time.perf_counter()
            result = compress(
                z,
                y,
                reduction=1 / fraction,
                n_classes=n_classes,
                rule="majority",
                edit_k=edit_k_for(full["served_k"]),
                x_val=z_val,
                y_val=y_val,
                seed=seed,
                loss=loss,
            )
            seconds.append(time.perf_counter() - started)
            got = scores(result.fit.prototypes, result.fit.labels, *common, fallback=1)
            changes.append(100 * (got["test_at_served_k"] - full["test_at_served_k"]))
            kept.append(result.loss)
        row = {
            "set": name,
            "noise": noise,
            "fraction": fraction,
            "seeds": seeds,
            "loss": loss,
            "kept_losses": kept,
            "full": full["test_at_served_k"],
            "change_points": changes,
            "median": float(np.median(changes)),
            "median_seconds": float(np.median(seconds)),
        }
        print(row, flush=True)
        yield row


def save_seed_row(row: dict) -> None:
    """Write one seeds row into learned_references_seeds.json as soon as it is measured,
    replacing the row of the same set, noise, loss and fraction (rows from before the loss
    was recorded were learned with f), so a long run keeps every fraction it finished."""
    path = RESULTS / "learned_references_seeds.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []

    def key(r: dict) -> tuple:
        return r["set"], r["noise"], r.get("loss", "f"), r["fraction"]

    rows = [r for r in rows if key(r) != key(row)] + [row]
    save_json("learned_references_seeds.json", {"machine": machine(), "rows": rows})


def _row(base, fraction, method, refs, labels, started, common, **extra) -> dict:
    seconds = time.perf_counter() - started
    return {
        **base,
        "fraction": fraction,
        "method": method,
        "references": len(labels),
        "seconds": seconds,
        **scores(refs, labels, *common, fallback=1),
        **extra,
    }


def markdown(rows: list[dict]) -> str:
    """The README's table: per set and noise, each method's test accuracy at its served k
    (k = 1 in brackets when it differs), the change from the full set, seconds."""
    out = [
        "| set | noise | kept | references | method | test acc. (served k) | vs full | "
        "at k = 1 | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((r["set"], r["noise"]) for r in rows):
        group = [r for r in rows if (r["set"], r["noise"]) == key]
        full = next(r for r in group if r["method"] == "full")
        order = sorted(
            group,
            key=lambda r: (
                r["method"] != "full",
                r["method"] != "hart",
                r["fraction"],
                METHODS.index(r["method"]),
            ),
        )
        for r in order:
            delta = r["test_at_served_k"] - full["test_at_served_k"]
            out.append(
                f"| {key[0]} | {key[1]:.0%} | {r['fraction']:.1%} | {r['references']:,} | "
                f"{r['method']}{', ' + r['loss'] + ' loss' if r.get('loss') else ''}"
                f"{' (edited)' if r.get('edited') else ''} | "
                f"{r['test_at_served_k']:.4f} ({r['served_k']}) | "
                f"{'' if r['method'] == 'full' else f'{100 * delta:+.2f}'} | "
                f"{r['test_at_1']:.4f} | {r.get('seconds', r.get('nca_fit_seconds', 0)):.1f} |"
            )
    return "\n".join(out)


def seeds_markdown(rows: list[dict]) -> str:
    """The README's seeds table: per set, noise, fraction and loss setting, the change at each
    seed, the median, (with "auto") the loss each seed kept and the median seconds of one
    compression (rows measured since it was recorded)."""
    out = [
        "| set | noise | kept | loss | change at each seed (points) | median | kept loss | "
        "median s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        changes = ", ".join(f"{c:+.2f}" for c in r["change_points"])
        kept = ", ".join(r.get("kept_losses", []))
        seconds = f"{r['median_seconds']:.1f}" if "median_seconds" in r else ""
        out.append(
            f"| {r['set']} | {r['noise']:.0%} | {r['fraction']:.0%} | "
            f"{r.get('loss', 'f')} | {changes} | {r['median']:+.2f} | {kept} | {seconds} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="usps,letters,usps784")
    parser.add_argument("--noise", default="0,0.25")
    parser.add_argument("--fractions", default="0.01,0.02,0.05,0.1")
    parser.add_argument("--save-models", help="write each clean model as an artifact here")
    parser.add_argument("--table", action="store_true", help="print the saved table, run none")
    parser.add_argument(
        "--seeds",
        type=int,
        help="only the default method over this many seeds, written to "
        "learned_references_seeds.json (rows of the sets, noise levels, fractions and loss run "
        "replace their previous ones)",
    )
    parser.add_argument(
        "--loss",
        choices=("auto", "f", "log"),
        default="auto",
        help="with --seeds: the learner's loss (auto, the default: chosen on validation)",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHOD_KEYS),
        help="the table's methods to run besides the full set, comma-separated, of "
        f"{', '.join(METHOD_KEYS)} (rows of methods not run are kept from the last run)",
    )
    parser.add_argument("--cache", help="keep the fitted NCA maps here and reuse them")
    args = parser.parse_args()
    if args.table:
        print(markdown(json.loads((RESULTS / "learned_references.json").read_text())["rows"]))
        seeds = RESULTS / "learned_references_seeds.json"
        if seeds.exists():
            print("\n" + seeds_markdown(json.loads(seeds.read_text())["rows"]))
        return
    fractions = [float(f) for f in args.fractions.split(",")]
    path = RESULTS / "learned_references.json"
    previous = json.loads(path.read_text())["rows"] if path.exists() else []
    sets = args.sets.split(",")
    if args.seeds:
        for name in sets:
            for noise in (float(n) for n in args.noise.split(",")):
                for row in seed_medians(name, noise, fractions, args.seeds, args.loss, args.cache):
                    save_seed_row(row)
        return
    keys = args.methods.split(",")
    unknown = [key for key in keys if key not in METHOD_KEYS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {', '.join(METHOD_KEYS)}")
    methods = {"full", *(METHOD_KEYS[key] for key in keys)}
    rows = []
    for name in sets:
        for noise in (float(n) for n in args.noise.split(",")):
            rows += run_set(name, noise, fractions, args.save_models, methods, args.cache)
    ran = {(r["set"], r["noise"], r["method"], r["fraction"]) for r in rows}
    ran |= {(r["set"], r["noise"], "hart") for r in rows if r["method"] == "hart"}

    def replaced(r: dict) -> bool:
        if r["method"] == "hart":
            return (r["set"], r["noise"], "hart") in ran
        return (r["set"], r["noise"], r["method"], r["fraction"]) in ran

    rows = [r for r in previous if not replaced(r)] + rows
    print_table(
        rows,
        [
            "set",
            "noise",
            "method",
            "fraction",
            "references",
            "served_k",
            "test_at_served_k",
            "test_at_1",
            "seconds",
        ],
    )
    save_json("learned_references.json", {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
