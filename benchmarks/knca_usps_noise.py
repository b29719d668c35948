"""The kNCA paper's Fig. 4 on USPS: kNN accuracy against test-time k under label noise.

0%, 25% and 50% of the training labels are resampled uniformly at random (over the 10
classes). We train NCA (k = 1), kNCA-majority and kNCA-all (k = 5 and 10), and LMNN from
metric-learn (benchmark-only dependency) as an external baseline, all to d = 32 on the
standardised inputs; Euclidean kNN on the standardised inputs is shown for reference. Votes
come from the corrupted training labels; accuracy is scored on the true test labels, for
test-time k = 1..15.

Usage: python benchmarks/knca_usps_noise.py [--noise 0,0.25,0.5] [--max-iter 60]
Needs ../shared/data/usps.npz (skips otherwise) and `pip install metric-learn` for LMNN.
Writes benchmarks/results/knca_usps_noise.json and benchmarks/results/knca_usps_noise.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import USPS_PATH
from harness.report import RESULTS, machine, save_json

TEST_KS = tuple(range(1, 16))


def accuracy_curve(z_train, y_train, z_test, y_test, n_classes):
    from service.core.knn import decide, exact_knn

    dist, idx = exact_knn(z_test, z_train, max(TEST_KS))
    labels = y_train[idx]
    return {
        k: float(np.mean(decide(labels[:, :k], dist[:, :k], n_classes)[0] == y_test))
        for k in TEST_KS
    }


def corrupt(y, fraction, n_classes, seed):
    rng = np.random.default_rng(seed)
    y = y.copy()
    chosen = rng.random(len(y)) < fraction
    y[chosen] = rng.integers(0, n_classes, chosen.sum())
    return y


def fit_ours(objective, k, X, y, max_iter, n_candidates, seed):
    from training import NCA

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(
            n_components=32,
            objective=objective,
            k=k,
            max_iter=max_iter,
            n_candidates=n_candidates,
            random_state=seed,
            options=dict(refresh_every=10, standardize=False),
        ).fit(X, y)
    return model.transform, model.n_iter_


def _patch_metric_learn() -> None:
    """metric-learn 0.7.0 passes scikit-learn's removed `force_all_finite` keyword; rename it."""
    import metric_learn._util as util

    original = util.check_X_y
    if getattr(original, "_ncaknn_patched", False):
        return

    def check_X_y(*args, **kwargs):
        if "force_all_finite" in kwargs:
            kwargs["ensure_all_finite"] = kwargs.pop("force_all_finite")
        return original(*args, **kwargs)

    check_X_y._ncaknn_patched = True
    util.check_X_y = check_X_y
    original_array = util.check_array

    def check_array(*args, **kwargs):
        if "force_all_finite" in kwargs:
            kwargs["ensure_all_finite"] = kwargs.pop("force_all_finite")
        return original_array(*args, **kwargs)

    util.check_array = check_array


def fit_lmnn(X, y, max_iter, seed):
    from metric_learn import LMNN

    _patch_metric_learn()

    model = LMNN(
        n_neighbors=5, n_components=32, max_iter=max_iter, random_state=seed, learn_rate=1e-6
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(X, y)
    return lambda Z: model.transform(Z).astype(np.float32), getattr(model, "n_iter_", max_iter)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--noise", default="0,0.25,0.5")
    parser.add_argument("--max-iter", type=int, default=60)
    parser.add_argument("--n-candidates", type=int, default=32)
    parser.add_argument("--lmnn-max-iter", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--methods", default="", help="comma-separated method name prefixes to run (default: all)"
    )
    args = parser.parse_args()
    if not USPS_PATH.is_file():
        print(f"skipped: {USPS_PATH} not found")
        return
    with np.load(USPS_PATH, allow_pickle=False) as d:
        X, y, X_test, y_test = d["X"], d["y"], d["X_test"], d["y_test"]
    mean, std = X.mean(0), X.std(0)
    std[std == 0] = 1
    X, X_test = ((X - mean) / std).astype(np.float32), ((X_test - mean) / std).astype(np.float32)
    methods = [
        ("Euclidean", None, 1),
        ("NCA", "nca", 1),
        ("kNCA-majority k=5", "knca-majority", 5),
        ("kNCA-majority k=10", "knca-majority", 10),
        ("kNCA-all k=5", "knca-all", 5),
        ("kNCA-all k=10", "knca-all", 10),
        ("LMNN (metric-learn)", "lmnn", 5),
    ]
    out_path = RESULTS / "knca_usps_noise.json"
    results = json.loads(out_path.read_text()) if out_path.is_file() else {}
    results["machine"] = machine()
    results.setdefault("runs", {})
    for noise in map(float, args.noise.split(",")):
        y_noisy = corrupt(y, noise, 10, args.seed)
        for name, objective, k in methods:
            if args.methods and not any(name.startswith(m) for m in args.methods.split(",")):
                continue
            t = time.perf_counter()
            try:
                if objective is None:
                    transform, n_iter = (lambda Z: Z), 0
                elif objective == "lmnn":
                    transform, n_iter = fit_lmnn(X, y_noisy, args.lmnn_max_iter, args.seed)
                else:
                    transform, n_iter = fit_ours(
                        objective, k, X, y_noisy, args.max_iter, args.n_candidates, args.seed
                    )
            except ImportError as exc:
                print(f"{name}: skipped ({exc})")
                continue
            except Exception as exc:  # an external baseline failing must not stop the others
                print(f"{name}: failed ({type(exc).__name__}: {exc})")
                continue
            seconds = time.perf_counter() - t
            curve = accuracy_curve(transform(X), y_noisy, transform(X_test), y_test, 10)
            run = {
                "noise": noise,
                "method": name,
                "train_k": k,
                "seconds": seconds,
                "n_iter": int(n_iter),
                "accuracy": curve,
            }
            results["runs"][f"{noise}|{name}"] = run
            print(
                json.dumps(
                    {
                        **run,
                        "accuracy": {
                            kk: round(v, 4) for kk, v in curve.items() if kk in (1, 5, 10, 15)
                        },
                    }
                ),
                flush=True,
            )
            save_json("knca_usps_noise.json", results)
    plot(results)
    from tables import knca_noise_table

    print(knca_noise_table(results))


def plot(results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noises = sorted({run["noise"] for run in results["runs"].values()})
    methods = sorted({run["method"] for run in results["runs"].values()})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(
        1, len(noises), figsize=(5 * len(noises), 4), sharey=False, squeeze=False
    )
    for ax, noise in zip(axes[0], noises, strict=True):
        for method in methods:
            run = results["runs"].get(f"{noise}|{method}")
            if run is None:
                continue
            ks = sorted(int(k) for k in run["accuracy"])
            ax.plot(
                ks,
                [run["accuracy"][str(k)] for k in ks],
                marker="o",
                markersize=3,
                color=colours[method],
                label=method,
            )
        ax.set_title(f"USPS, {int(noise * 100)}% training labels resampled")
        ax.set_xlabel("test-time k")
        ax.set_ylabel("test accuracy (true labels)")
        ax.grid(alpha=0.3)
    for ax in axes[0]:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "knca_usps_noise.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
