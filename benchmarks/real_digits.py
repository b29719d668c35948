"""The default fit on the real digits, stage by stage, beside the tree before a change.

Fits ``NCA(n_components=32, random_state=0, **setting)`` on a data set and scores 1-NN and
5-NN test error in the learned space. Every run is a process of its own, run alone, so its
peak RSS is its own; the machine's float32 GEMM rate is measured just before each run and
printed beside it (this machine's speed moves from day to day).

Sets (the data are written once by this process and read by every run, so both trees fit
the same rows):

- ``mnist``: the real MNIST digits, 60,000 training and 10,000 test rows
  (``../shared/data/mnist.npz``; skipped when absent);
- ``mnist20k``: its first 20,000 training rows, the same test rows;
- ``mnist_shifted``: the 60,000 training digits and each of them shifted by one pixel up,
  down, left and right (zero fill): 300,000 training rows, the same test rows (the rows a
  fit holds out to judge its stages have their shifted twins among the training rows, so
  its held-out scores read high);
- ``mnist_shifted_judged``: the same, but with a validation split that has no twin among
  the training rows: JUDGED_ROWS evenly spaced training digits are passed as ``X_val`` (the
  rows that judge the stages) and only the other 55,904 are shifted into training rows
  (279,520), so the judge sees rows as far from the references as a test row is;
- ``mnist_shifted_refs``: the map fitted on the 60,000 training digits alone, and the test
  rows classified against ``mnist_shifted``'s 300,000 rows as references (what
  ``python -m training references add`` gives a model: its map, more references);
- ``mnist_shifted8_refs``: the same with all eight one-pixel shifts (the diagonals too),
  540,000 references;
- ``clustered20k``: 20,000 x 128 rows of ``training.data.synthetic.clustered_classes`` with
  ``benchmarks/scale.py``'s distribution (20 classes of 4 clusters in a 24-dimensional
  subspace), 5,000 test rows;
- ``moving50k``: 50,000 x 128 rows with moving neighbourhoods (``scale.py --family moving``:
  32 interleaved clusters per class and a style shared across classes that dominates the
  raw distances), 5,000 test rows;
- ``letters``, ``shuttle``: UCI's letters (16,000 training and 4,000 test rows of 16
  features, 26 classes) and Shuttle (43,500 and 14,500 rows of 9, 7 classes), as
  ``uci_served_k.py`` splits them (``benchmarks/prepare_uci.py`` writes them; skipped when
  absent). Both are fitted on candidate sets (above 8,192 rows), so a change to the
  candidate stage or the finish shows on them; the map has min(32, D) components.

Settings: ``default`` (the estimator's defaults), ``no-stall`` (``stop_stalled_stages=False``:
what the stage-stopping rule saves and costs), ``budget:S`` (``max_seconds=S``),
``finish_pairs:P`` (the defaults with ``training.model.plan.FINISH_PAIRS = 2**P``: the
(query row, point) pairs of one evaluation of the exact finish, at most; 30 is the default),
``params:NAME=VALUE+NAME=VALUE`` (any estimator parameters, values read as JSON where they
look like numbers, lists or booleans: ``params:objective=knca-majority+k=5``; a NAME in
capitals sets that constant of ``training.model.plan`` for the run instead, of the same
type: ``params:FINISH_MAX_POINTS=32768+FINISH_PAIRS=536870912+random_state=1``; only the
constants ``resolve_plan`` reads when a fit starts take effect, and the row records the
plan the fit ran, ``plan_``).
``--path`` also records, for every run, the test errors of the map after each iteration of
the fit (``path``: iteration, the map's Frobenius norm, 1-NN and 5-NN error; the maps come
from the estimator's ``callback``, on the standardised inputs, and are scored as the
fitted one is; the start map has no row, and ``kept_iteration`` says which row the fit
returned; with ``--before``, a tree from 3b24e80 on, whose callback takes the map and the
iteration): where along the fit the test error moves, and by how much between two
neighbouring iterations (the noise a rule that stops or keeps a stage has to see through).
``--before TREE`` runs ``default`` also with the code of another checkout (e.g. ``git worktree
add /tmp/base <commit>``); settings that tree's estimator lacks are not run there.

The kNN rule for the errors is the same for every run and tree: majority of the k nearest
(squared Euclidean, exact); a tie goes to the nearest neighbour's class when it is among the
tied classes, else to the lowest tied class index.

Usage: taskset -c 0,1 python benchmarks/real_digits.py [--sets mnist,clustered20k]
       [--settings default,no-stall,budget:60] [--before /tmp/base] [--path]
       [--name real_digits]
Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import gemm_gflops, machine, peak_rss_mib, print_table, save_json

HERE = Path(__file__).resolve().parents[1]
MNIST = HERE.parent / "shared" / "data" / "mnist.npz"
SETS = (
    "mnist",
    "mnist20k",
    "mnist_shifted",
    "mnist_shifted_judged",
    "mnist_shifted_refs",
    "mnist_shifted8_refs",
    "clustered20k",
    "moving50k",
    "letters",
    "shuttle",
)
SHIFTS = ((-1, 0), (1, 0), (0, -1), (0, 1))  # (rows, columns) of mnist_shifted's copies
DIAGONALS = ((-1, -1), (-1, 1), (1, -1), (1, 1))  # ... and mnist_shifted8_refs' others
JUDGED_ROWS = 4096  # mnist_shifted_judged's validation digits (the estimator holds out as many)


def shifted_digits(X: np.ndarray, y: np.ndarray, shifts=SHIFTS) -> tuple[np.ndarray, np.ndarray]:
    """X (N, 784) of 28 x 28 images and each of them moved by ``shifts`` ((rows, columns)
    each), zero fill: (((1 + S) N, 784), ((1 + S) N,)), the originals first."""
    if X.ndim != 2 or X.shape[1] != 28 * 28:
        raise ValueError(f"shifted_digits takes 28 x 28 images as rows of 784, got {X.shape}")
    images = X.reshape(-1, 28, 28)
    copies = [X]
    for dy, dx in shifts:
        moved = np.zeros_like(images)
        rows_to, rows_from = slice(max(dy, 0), 28 + min(dy, 0)), slice(max(-dy, 0), 28 - max(dy, 0))
        cols_to, cols_from = slice(max(dx, 0), 28 + min(dx, 0)), slice(max(-dx, 0), 28 - max(dx, 0))
        moved[:, rows_to, cols_to] = images[:, rows_from, cols_from]
        copies.append(moved.reshape(len(X), -1))
    return np.concatenate(copies), np.tile(y, len(copies))


def twin_free_split(X: np.ndarray, y: np.ndarray, judged: int = JUDGED_ROWS) -> dict:
    """{X, y, X_val, y_val}: ``judged`` evenly spaced rows of X as the validation split, and
    the others with their SHIFTS copies as the training rows, so that no validation row has
    a shifted twin among them."""
    held = np.linspace(0, len(X) - 1, judged).round().astype(np.int64)
    kept = np.setdiff1d(np.arange(len(X)), held)
    X_train, y_train = shifted_digits(X[kept], y[kept])
    return {"X": X_train, "y": y_train, "X_val": X[held], "y_val": y[held]}


def write_set(name: str, folder: Path) -> Path | None:
    """The set's X, y, X_test, y_test as one .npz in ``folder``; None when its data is absent."""
    from scale import FAMILIES

    from training.data.synthetic import clustered_classes

    if name in ("letters", "shuttle"):
        from uci_served_k import uci_sets

        found = dict(uci_sets([name]))  # empty when benchmarks/prepare_uci.py has not run
        if not found:
            return None
        X, y, Xt, yt = found[name]
        arrays = dict(X=X, y=y, X_test=Xt, y_test=yt)
    elif name.startswith("mnist"):
        if not MNIST.exists():
            return None
        data = np.load(MNIST)
        rows = 20_000 if name == "mnist20k" else len(data["y"])
        arrays = dict(
            X=data["X"][:rows], y=data["y"][:rows], X_test=data["X_test"], y_test=data["y_test"]
        )
        if name == "mnist_shifted":
            arrays["X"], arrays["y"] = shifted_digits(arrays["X"], arrays["y"])
        if name == "mnist_shifted_judged":
            arrays.update(twin_free_split(arrays["X"], arrays["y"]))
        if name.endswith("_refs"):  # fitted on X, scored against these references
            shifts = SHIFTS + DIAGONALS if name == "mnist_shifted8_refs" else SHIFTS
            X_references, y_references = shifted_digits(arrays["X"], arrays["y"], shifts)
            arrays.update(X_references=X_references, y_references=y_references)
    else:
        family = "clustered" if name.startswith("clustered") else "moving"
        n = 20_000 if family == "clustered" else 50_000
        X, y = clustered_classes(n, n_features=128, sample_seed=1, **FAMILIES[family])
        Xt, yt = clustered_classes(5_000, n_features=128, sample_seed=2, **FAMILIES[family])
        arrays = dict(X=X, y=y, X_test=Xt, y_test=yt)
    path = folder / f"{name}.npz"
    np.savez(path, **arrays)
    return path


def knn_errors(z_train, y_train, z_test, y_test, ks=(1, 5)) -> dict:
    """Test error of the k-NN majority vote for each k (exact search, float64 distances in
    blocks of at most 1,024 test rows and 2^25 distances, or 16 rows above 2^21 references;
    a tie goes to the nearest neighbour's class when it is tied, else to the lowest tied
    class index)."""
    z_train = np.asarray(z_train, np.float64)
    sq_train = (z_train**2).sum(axis=1)
    n_classes = int(max(y_train.max(), y_test.max())) + 1
    wrong = dict.fromkeys(ks, 0)
    step = max(16, min(1024, 2**25 // len(z_train)))  # (step, N) float64 distances: 256 MiB
    for start in range(0, len(z_test), step):
        block = np.asarray(z_test[start : start + step], np.float64)
        dist = sq_train[None, :] - 2 * block @ z_train.T  # (b, N), + ||q||^2 omitted
        part = np.argpartition(dist, max(ks), axis=1)[:, : max(ks)]  # (b, max k), unordered
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(dist, part, 1), 1), 1)
        labels = y_train[order]  # (b, max k), nearest first
        for k in ks:
            votes = np.zeros((len(block), n_classes))
            np.add.at(votes, (np.arange(len(block))[:, None], labels[:, :k]), 1.0)
            # ties: the nearest neighbour's class gets a half vote more than any other
            votes[np.arange(len(block)), labels[:, 0]] += 0.5
            wrong[k] += int((votes.argmax(axis=1) != y_test[start : start + step]).sum())
    return {k: wrong[k] / len(y_test) for k in ks}


def setting_params(setting: str) -> dict:
    if setting == "default":
        return {}
    if setting == "no-stall":
        return {"stop_stalled_stages": False}
    if setting.startswith("budget:"):
        return {"max_seconds": float(setting.split(":", 1)[1])}
    if setting.startswith("finish_pairs:"):  # the defaults, the finish's pairs set: one_run
        return {}
    if setting.startswith("params:"):  # params:objective=knca-majority+k=5
        params = {}
        for item in setting.split(":", 1)[1].split("+"):
            name, _, text = item.partition("=")
            try:  # numbers, lists, true / false / null as JSON; anything else as text
                params[name] = json.loads(text)
            except json.JSONDecodeError:
                params[name] = text
        return params
    raise SystemExit(
        f"unknown setting {setting!r}: default, no-stall, budget:SECONDS, finish_pairs:P or "
        "params:NAME=VALUE+..."
    )


def one_run(data_path: str, setting: str, path: bool = False) -> dict:
    """One fit in this process (whose ``training`` is the tree on sys.path); with ``path``,
    the test errors after each of its iterations too (``fit_path``)."""
    import inspect

    from training import NCA

    try:  # a tree with FitOptions (issue 56) takes the advanced settings as options
        from training.model.options import OPTION_NAMES, with_options
    except ImportError:  # a tree before it takes every setting as a parameter
        OPTION_NAMES, with_options = (), dict
    params = setting_params(setting)
    constants = {name: params.pop(name) for name in list(params) if name.isupper()}
    if constants:  # params:FINISH_PAIRS=...: the plan's constants for this run
        import training.model.plan as plan

        for name, value in constants.items():
            if not hasattr(plan, name):  # a misspelt constant must not run as the default
                raise SystemExit(f"{setting!r}: training.model.plan has no constant {name}")
            if type(value) is not type(getattr(plan, name)):
                raise SystemExit(
                    f"{setting!r}: {name}={value!r} must be a {type(getattr(plan, name)).__name__}"
                )
            setattr(plan, name, value)
    if setting.startswith("finish_pairs:"):  # finish_pairs:27: 2^27 (query row, point) pairs
        import training.model.plan as plan  # an evaluation of the exact finish, at most

        plan.FINISH_PAIRS = 2 ** int(setting.split(":", 1)[1])
    accepted = set(inspect.signature(NCA.__init__).parameters) | set(OPTION_NAMES)
    if any(name not in accepted for name in params):
        return {"skipped": f"this tree's NCA has no {sorted(set(params) - accepted)}"}
    data = np.load(data_path)
    X, y, Xt, yt = data["X"], data["y"], data["X_test"], data["y_test"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        started = time.perf_counter()
        validation = {}  # a set's own validation split (mnist_shifted_judged), else none
        if "X_val" in data.files:
            validation = {"X_val": data["X_val"], "y_val": data["y_val"]}
        maps = []  # (iteration, A (d * D,) on standardised inputs) after each iteration

        def keep_map(flat, iteration):
            maps.append((int(iteration), np.array(flat, dtype=np.float64)))

        d = min(32, X.shape[1])
        settings = {"n_components": d, "random_state": 0, **params}
        if path:
            settings["callback"] = keep_map
        model = NCA(**with_options(settings))
        model.fit(X, y, **validation)
        fit_s = time.perf_counter() - started
    X_ref, y_ref = X, y  # the references: the training rows, or the set's own
    if "X_references" in data.files:
        X_ref, y_ref = data["X_references"], data["y_references"]
    errors = knn_errors(model.transform(X_ref), y_ref, model.transform(Xt), yt)
    path_rows = fit_path(model, maps, X_ref, y_ref, Xt, yt) if path else None
    fit_plan = getattr(model, "plan_", None)  # the resolved FitPlan (a tree before it: none)
    return {
        "fit_s": fit_s,
        "err_1nn": errors[1],
        "err_5nn": errors[5],
        "peak_rss_mib": peak_rss_mib(),
        "n_iter": int(model.n_iter_),
        "stop_reason": model.stop_reason_,
        "evaluations": getattr(model, "n_evaluations_", None),
        "refreshes": getattr(model, "n_refreshes_", None),
        "init_scale": getattr(model, "init_scale_", None),
        "stages": getattr(model, "stages_", None),
        "plan": fit_plan.describe() if hasattr(fit_plan, "describe") else None,  # as the fit ran
        "path": path_rows,
        "kept_iteration": getattr(model, "kept_iteration_", None),  # the path's row kept
        # the neighbour mass the candidate sets left out at the candidate stage's last
        # iteration (Problem.outside_mass on its fixed sample rows; None without candidates)
        "candidate_outside_mass": next(
            (
                entry["candidate_outside_mass"]
                for entry in reversed(getattr(model, "history_", None) or [])
                if entry.get("candidate_outside_mass") is not None
            ),
            None,
        ),
    }


def fit_path(model, maps, X_ref, y_ref, X_test, y_test) -> list[dict]:
    """The test errors of each map the fit stepped through (``maps``: (iteration, A raveled)
    from the estimator's ``callback``, which is not called for the start map, so iteration
    0 has no row), scored as the fitted map is: a copy of the model is given A (d, D) as its
    map on standardised rows by the estimator's own ``_set_map`` (with the fit's ``mean_``
    and ``scale_``), and its ``transform`` projects the rows."""
    step = copy.copy(model)  # the fitted model's attributes; _set_map replaces its map
    d = model.components_.shape[0]
    rows = []
    for iteration, flat in maps:
        A = flat.reshape(d, -1)  # (d, D)
        step._set_map(A, model.mean_, model.scale_)
        errors = knn_errors(step.transform(X_ref), y_ref, step.transform(X_test), y_test)
        rows.append(
            {
                "iteration": iteration,
                "norm": float(np.linalg.norm(A)),
                "err_1nn": errors[1],
                "err_5nn": errors[5],
            }
        )
    return rows


def run_in(tree: Path, data_path: Path, setting: str, path: bool = False) -> dict:
    """one_run in a fresh process that imports ``training`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, __file__, "--one", str(data_path), setting]
    if path:
        command.append("--path")
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree} {setting}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="mnist,mnist20k,clustered20k,moving50k")
    parser.add_argument("--settings", default="default,no-stall")
    parser.add_argument("--before", type=Path, help="another checkout to fit 'default' with")
    parser.add_argument("--before-sets", default="mnist20k", help="the sets --before runs on")
    parser.add_argument("--name", default="real_digits")
    parser.add_argument("--path", action="store_true", help="test errors after each iteration")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(*args.one, path=args.path), default=float))
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.sets.split(","):
            path = write_set(name, Path(folder))
            if path is None:
                print(f"{name}: data absent, skipped")
                continue
            runs = [(HERE, "after", s) for s in args.settings.split(",")]
            if args.before is not None and name in args.before_sets.split(","):
                runs.insert(0, (args.before.resolve(), "before", "default"))
            for tree, label, setting in runs:
                gemm = gemm_gflops()
                result = run_in(tree, path, setting, args.path)
                row = {"set": name, "tree": label, "setting": setting, "gemm_gflops": gemm}
                rows.append({**row, **result})
                print(
                    json.dumps({k: v for k, v in rows[-1].items() if k not in ("stages", "path")})
                )
    columns = ["set", "tree", "setting", "fit_s", "err_1nn", "err_5nn", "peak_rss_mib"]
    print_table([r for r in rows if "skipped" not in r], [*columns, "stop_reason", "gemm_gflops"])
    stage_rows = [
        {"set": r["set"], "tree": r["tree"], "setting": r["setting"], **stage}
        for r in rows
        for stage in r.get("stages") or []
    ]
    stage_columns = ["stage", "seconds", "iterations", "evaluations", "refreshes"]
    print_table(
        stage_rows,
        ["set", "tree", "setting", *stage_columns, "start_score", "end_score", "stop_reason"],
    )
    path_rows = [
        {"set": r["set"], "tree": r["tree"], "setting": r["setting"], **step}
        for r in rows
        for step in r.get("path") or []
    ]
    if path_rows:
        print_table(
            path_rows, ["set", "tree", "setting", "iteration", "norm", "err_1nn", "err_5nn"]
        )
    facts = machine()  # the rate at the end of the run, printed by save_json
    command = "python benchmarks/real_digits.py " + " ".join(sys.argv[1:])
    save_json(f"{args.name}.json", {"command": command, "machine": facts, "rows": rows})


if __name__ == "__main__":
    main()
