"""The training job, top to bottom: data -> split -> fit -> evaluate -> artifact + report."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import scipy.sparse as sp
import torch.distributed as dist
from sklearn.exceptions import ConvergenceWarning

from service.core.artifact import ArtifactError, OutputClaim, write_artifact
from service.core.artifact.ownership import check_writable, is_artifact
from service.core.knn import project
from training.config import TrainConfig
from training.data.datasets import (
    BUILTIN_DATASETS,
    DataError,
    Dataset,
    Split,
    default_memory_budget,
    fingerprint_from_row_digests,
    load_dataset,
    make_split,
    row_digests,
)
from training.distributed.ranks import ProcessGroup, agreed_value, current_group
from training.distributed.sharded_stats import gather_array
from training.errors import (
    ConfigError,
    Interrupted,
    check_lock_timeout,
    check_seed,
    describe_os_error,
    holding_interrupts,
    writing,
)
from training.evaluation.baselines import BASELINES
from training.evaluation.calibration import calibrate, outlier_report
from training.evaluation.cross_fit import check_k_folds, choose_served_k, largest_class
from training.evaluation.evaluate import (
    K_VALUES,
    SERVED_VOTES,
    knn_accuracies,
    knn_accuracies_by_rule,
    knn_predictions,
    nearest_references,
    parse_vote,
    sparse_knn_accuracies,
)
from training.evaluation.report import (
    json_bytes,
    peak_memory_mib,
    plot_embedding,
    plot_objective,
)
from training.evaluation.report_page import warnings_of, write_report_page
from training.model import sparse_input
from training.model.estimator import NCA
from training.model.options import with_options
from training.numerics import evenly_spaced_rows
from training.progress import StageBar, progress_mode
from training.publish import check_publish_link, publish
from training.references.compress import reference_set_record
from training.references.learned import check_budget
from training.state_file import checkpoint_beside


def _remove_checkpoint(config: TrainConfig, checkpoint: Path | None, world_size: int, log):
    """The fit's checkpoint, once the artifact is written: the files the fit wrote
    (``fit-rank{R}.npz``, ``fit-rank{R}.previous.npz`` and the temporary files of a save
    that was killed, ``.fit-rank{R}.*.tmp``), and the directory beside --out when that
    leaves it empty. Nothing else: a file the user put there stays, with the directory.
    A file that cannot be removed (a read-only directory) is a warning, not a failure: the
    artifact is written, and the next fit of other data refuses the stale state."""
    if checkpoint is None:
        return
    ours = []
    for rank in range(world_size):
        ours += [checkpoint / f"fit-rank{rank}.npz", checkpoint / f"fit-rank{rank}.previous.npz"]
        ours += sorted(checkpoint.glob(f".fit-rank{rank}.*.tmp"))
    for path in ours:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log(
                f"warning: the artifact is written, but its checkpoint stays: {describe_os_error(exc)}"
            )
    if config.checkpoint_dir == "auto":
        with contextlib.suppress(OSError):  # not empty (files not ours), or already gone
            checkpoint.rmdir()


def build_estimator(config: TrainConfig, n_features: int) -> NCA:
    """The estimator of the run: the configuration's settings, validated at the k values the
    artifact may serve (the served k is chosen among them on validation: ``choose_k``), with
    a bar per stage when the run shows one (``training.progress``)."""
    bar = StageBar() if progress_mode(config.progress, config.quiet) == "bar" else None
    settings = {**config.estimator_params(n_features), "validation_k": K_VALUES, "progress": bar}
    return NCA(**with_options(settings))


# query x reference x dimension products a baseline's search may take, at most: a map that
# keeps D dimensions (euclidean, whitening, rca) is scored on evenly spaced validation and
# test rows within it (on MNIST, 1,622 of each against 54,000 references at D = 784), a
# d-dimensional one on every row. The learned map is always scored on every row.
BASELINE_SEARCH_BUDGET = 2**36
MIN_BASELINE_ROWS = 1000


def baseline_rows(n_rows: int, n_references: int, dimensions: int) -> np.ndarray:
    """The rows of a split (n_rows) a baseline of ``dimensions`` is scored on: every row, or
    evenly spaced ones within BASELINE_SEARCH_BUDGET (never fewer than MIN_BASELINE_ROWS)."""
    budget = BASELINE_SEARCH_BUDGET // max(1, n_references * dimensions)
    return evenly_spaced_rows(n_rows, max(MIN_BASELINE_ROWS, budget))


def evaluate_baselines(split, mean, scale, d: int, vote: str) -> dict:
    """kNN accuracies of each baseline map on the same split (validation and test), with the
    vote the artifact serves (a rule, or "soft@t": ``evaluate.parse_vote``); maps that keep
    D dimensions on evenly spaced rows within BASELINE_SEARCH_BUDGET (``val_rows``,
    ``test_rows`` say how many)."""
    Xtr = (split.X_train - mean) / scale
    Xtr32 = Xtr.astype(np.float32)  # the embeddings by float32 GEMMs
    n_classes = len(split.classes)
    results = {}
    for name, make in BASELINES.items():
        try:
            A = make(Xtr, split.y_train, d)
        except (np.linalg.LinAlgError, ValueError) as exc:
            results[name] = {"error": str(exc)}
            continue
        A32 = A.astype(np.float32)
        z_tr = Xtr32 @ A32.T
        record = {"n_components": int(A32.shape[0])}
        for part, X, y in (("val", split.X_val, split.y_val), ("test", split.X_test, split.y_test)):
            rows = baseline_rows(len(X), len(z_tr), A32.shape[0])
            z = ((X[rows] - mean) / scale).astype(np.float32) @ A32.T
            record[f"{part}_accuracy"] = knn_accuracies(
                z_tr, split.y_train, z, y[rows], n_classes, K_VALUES, vote
            )
            record[f"{part}_rows"] = len(rows)
        results[name] = record
    return results


def resolve_out(out: str | None, data_name: str, now: float | None = None) -> Path:
    """The artifact path: --out with '{timestamp}' replaced by the UTC time ``now`` (seconds
    since the epoch; default: the clock), or models/<data> when --out is not given. An
    empty --out is refused: it is a path mistyped, not a request for the default."""
    if out is None:
        return Path("models") / data_name
    if not out.strip():
        raise ConfigError(f"--out {out!r}: expected a directory path, got an empty one")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return Path(out.replace("{timestamp}", stamp))


def run(config: TrainConfig, *, log=print) -> dict:
    """Run the whole job; returns the report. Raises DataError / ConfigError / ValueError
    on bad input.

    Data-parallel (under ``torchrun``, a process group initialised): every rank reads the
    labels, plans the same split, and takes its rows of the training and validation splits
    (``split_data``); the fit is the data-parallel estimator's; the embeddings are gathered,
    and rank 0 alone evaluates, writes the artifact and publishes it while the other ranks
    wait at a barrier. Rank 0 returns the report, the others an empty dict."""
    started = time.perf_counter()
    group = current_group()
    check_seed(config.seed)
    check_lock_timeout(config.lock_timeout)
    check_k_folds(config.k_folds, distributed=group.is_distributed, prototypes=config.prototypes)
    config.check_estimator_settings()  # an option's value: refused before the data is read
    out = resolve_out(config.out, _data_name(config))
    check_publish_link(config.publish, out)
    # refused before any work when --out holds anything we did not write; its version now,
    # which must still be there when the artifact replaces it (``OutputClaim.turn``)
    with writing("the artifact", out):  # a read-only disk: said now, not after the fit
        claim = OutputClaim(out)
    if config.publish:  # ... and for the link, before --out is replaced by the new version
        with writing("the --publish link", Path(config.publish).absolute()):
            check_writable(config.publish)
    check_checkpoint_dir(checkpoint_dir_for(config, out), config.checkpoint_dir, out)
    data: Dataset = load_dataset(
        config.data,
        labels=config.labels,
        label_column=config.label_column,
        memory_map=True,
        memory_budget=memory_budget(config.memory_budget_gib),
        for_training=True,  # labels checked before any feature is read
        sparse=True,  # a scipy.sparse .npz is fitted as CSR, never densified
    )
    if sp.issparse(data.X):  # the settings a sparse X cannot take, before anything is said
        check_sparse_settings(config, data.X.shape[1], memory_budget(config.memory_budget_gib))
    split = split_data(data, config, group)
    del data  # a data-parallel rank keeps only its rows
    _check_prototypes(config, split, group)
    if not group.is_distributed:  # (a data-parallel run never cross-fits)
        check_k_folds(config.k_folds, prototypes=config.prototypes, largest=largest_class(split))
    config.check_against_features(split.X_train.shape[1])
    estimator = build_estimator(config, split.X_train.shape[1])
    parallel = f", {group.world_size} ranks ({group.backend})" if group.is_distributed else ""
    log(
        f"data {_data_name(config)}: {split.n_train} train / {split.n_val} validation / "
        f"{split.X_test.shape[0]} test, D={split.X_train.shape[1]}, {len(split.classes)} classes; "
        f"learning d={estimator.n_components} ({config.objective}){parallel}"
    )
    checkpoint = checkpoint_dir_for(config, out)
    convergence_warnings = fit_estimator(estimator, split, checkpoint)
    if estimator.resumed_iterations_ or estimator.resumed_stages_:
        log(
            f"resumed from {checkpoint}: {estimator.resumed_stages_} stage(s) were done, "
            f"{estimator.resumed_iterations_} iteration(s) in all"
        )
    evaluation = evaluate(estimator, split, config, group, log=log)
    report: dict = {}
    # from the artifact's write to the job's end a first SIGINT / SIGTERM waits (a second
    # one does not); the other ranks hold from the barrier, where they wait for rank 0
    with contextlib.ExitStack() as ending:
        if group.rank == 0:
            report = {
                "artifact": str(out),
                **build_report(
                    config, _data_name(config), split, estimator, evaluation, convergence_warnings
                ),
            }
            # writers of --out take turns (waiting at most --lock-timeout); one that landed
            # meanwhile is kept
            with claim.turn(timeout=config.lock_timeout):
                hold = ending.enter_context(holding_interrupts(None))
                save_artifact(out, config, _data_name(config), split, estimator, evaluation, report)
                try:  # --publish too within the turn: its writers take turns as well
                    _finish(
                        config, out, checkpoint, group, estimator, evaluation, report, log, started
                    )
                except Interrupted as exc:  # the second signal: the artifact is written
                    exc.written = str(out)
                    raise
        else:
            hold = ending.enter_context(holding_interrupts(None))
        if group.is_distributed:
            dist.barrier()  # the other ranks end after the artifact exists
        if hold.signum is not None:
            name = signal.Signals(hold.signum).name
            log(f"{name} arrived while {out} was being written: the job finished first")
    return report


def _finish(config, out, checkpoint, group, estimator, evaluation, report, log, started) -> None:
    """After the artifact's write: its report page, --publish, the checkpoint removed, and
    the lines that say what was written (with the seconds since ``started``)."""
    page = _write_page(out, log)
    if config.publish:
        try:
            publish(config.publish, out)
        except OSError as exc:  # the link alone failed: say that the artifact is there
            raise ArtifactError(f"{out} is written, but {describe_os_error(exc)}") from exc
        log(f"published {config.publish} -> {out}")
    _remove_checkpoint(config, checkpoint, group.world_size, log)
    log(
        f"wrote {out}: {_served_line(evaluation)}; {estimator.n_iter_} iterations, "
        f"{estimator.stop_reason_}, {time.perf_counter() - started:.1f} s"
    )
    # what report.html puts first, on screen too, but for the fit's own warnings, which
    # fit_estimator printed when the fit returned
    printed = set(report.get("training", {}).get("warnings", []))
    for warning in warnings_of(report):
        if warning not in printed:
            log(f"warning: {warning}")
    if page is not None:
        log(f"report: {page}")


def _served_line(evaluation) -> str:
    """What the served (k, vote) scores on the test rows, beside the Euclidean baseline; or
    that there are no test rows to score (the data's X_test was empty, or too few rows of
    each class for --test-size to take one)."""
    k, rule = evaluation.default_k, evaluation.vote  # "soft@0.5": the soft vote at t = 0.5
    if not evaluation.test_accuracy:
        return f"served k={k}, {rule} vote; no test rows, so no test accuracy"
    if "euclidean" in evaluation.baselines:
        euclidean = evaluation.baselines["euclidean"].get("test_accuracy", {})
        baseline = f"Euclidean baseline {euclidean.get(k, float('nan')):.4f}"
    else:
        baseline = "baselines not computed: no rank holds the raw training set"
    accuracy = evaluation.test_accuracy.get(k)
    if accuracy is None:  # a training k outside K_VALUES, served for want of validation rows
        measured = ", ".join(map(str, sorted(evaluation.test_accuracy)))
        return f"served k={k}, {rule} vote; test accuracy measured at k = {measured} only"
    return f"test accuracy {accuracy:.4f} at k={k}, {rule} vote ({baseline})"


def _write_page(out: Path, log) -> Path | None:
    """report.html beside the artifact, and its path; None, with a warning that says why
    (a full disk: the path and the cause), when it cannot be written. The model is written
    whether or not this works, so the job still succeeds."""
    try:
        return write_report_page(out)
    except OSError as exc:
        reason = describe_os_error(exc)
    except (ArtifactError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    log(
        f"warning: report.html not written ({reason}); the model is; "
        f"python -m training report {out} tries again"
    )
    return None


def memory_budget(gib: float | None) -> int | None:
    """--memory-budget-gib in bytes (ConfigError for a value that is not a positive finite
    number), else the default budget (``training.data.datasets.default_memory_budget``)."""
    if gib is None:
        return default_memory_budget()
    if not (isinstance(gib, (int, float)) and 2**-20 <= gib < float("inf")):
        raise ConfigError(
            f"--memory-budget-gib={gib!r} must be a finite number of GiB, at least 2^-20 (one KiB)"
        )
    return min(int(gib * 2**30), 2**62)  # beyond any machine: no limit in effect


# The sparse fit's memory per (component, feature): about 25 float64 copies of the (d, D)
# map, L-BFGS's history, the gradient and the randomized SVD's working set
# (training.model.sparse_input)
SPARSE_FIT_MAP_COPIES = 25


def check_sparse_settings(config: TrainConfig, n_features: int, budget: int | None) -> None:
    """ConfigError naming a setting a sparse X cannot take (``--standardize feature``,
    ``--init lda``, ``--prototypes``, ...: ``training.model.sparse_input.check_settings``),
    or a d whose copies of the (d, D) map exceed the memory budget (a few stored values
    over a vast D would otherwise fail in the fit)."""
    settings = SimpleNamespace(**config.estimator_params(n_features))
    try:
        sparse_input.check_settings(settings, distributed=False, n_features=n_features)
    except ValueError as exc:
        raise ConfigError(f"--data {config.data} is a sparse matrix: {exc}") from None
    d = settings.n_components or n_features
    needed = SPARSE_FIT_MAP_COPIES * d * n_features * 8
    if budget is not None and needed > budget:
        raise ConfigError(
            f"--data {config.data} has {n_features} features: at d = {d} the fit holds about "
            f"{SPARSE_FIT_MAP_COPIES} copies of the ({d}, {n_features}) map, "
            f"{needed / 2**30:.2f} GiB, over the memory budget of {budget / 2**30:.2f} GiB "
            "(--memory-budget-gib); choose a smaller --n-components or fewer features"
        )


def _check_prototypes(config: TrainConfig, split, group: ProcessGroup) -> None:
    """--prototypes (when given) against the training split, before the fit (ConfigError)."""
    if config.prototypes is None:
        return
    if group.is_distributed:
        raise ConfigError(
            "--prototypes learns the prototypes from every training row in one process; a "
            "data-parallel run holds a shard per rank: train without it, then run "
            "`python -m training references condense --method prototypes` on the artifact"
        )
    try:
        check_budget(
            split.y_train,
            len(split.classes),
            config.prototypes,
            split.classes.tolist(),
            name="--prototypes",
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _data_name(config: TrainConfig) -> str:
    """The data set's name: the built-in set's, or the file's stem."""
    return config.data if config.data in BUILTIN_DATASETS else Path(config.data).stem


def split_data(data: Dataset, config: TrainConfig, group: ProcessGroup) -> Split:
    """The run's split (``make_split``): under torchrun this rank's rows, which must be
    dense."""
    if group.is_distributed and sp.issparse(data.X):
        raise DataError(
            f"--data {config.data} is a sparse matrix: a data-parallel run (torchrun) takes "
            "dense rows; fit it in one process (python -m training)"
        )
    return make_split(
        data,
        test_size=config.test_size,
        val_size=config.val_size,
        seed=config.seed,
        rank=group.rank,
        world_size=group.world_size,
    )


def checkpoint_dir_for(config: TrainConfig, out: Path) -> Path | None:
    """Where the fit's checkpoint goes: ``--checkpoint-dir``, or ``.OUT.checkpoint`` beside
    ``--out`` (auto; for ``--out .../{timestamp}`` the name as given, so that a restarted
    job finds it), or None (none)."""
    if config.checkpoint_dir.strip().lower() == "none":
        return None
    if config.checkpoint_dir == "auto":
        named = Path(config.out) if config.out and "{timestamp}" in config.out else out
        return checkpoint_beside(named)
    return Path(config.checkpoint_dir)


def check_checkpoint_dir(checkpoint: Path | None, given: str, out: Path) -> None:
    """A checkpoint directory the fit can use, checked before the data is read: a directory
    or a path that can become one (created at the first save), not a file, and not under
    one; nor ``out`` or a path inside it, also through a symbolic link (the artifact
    replaces ``out`` whole, and a checkpoint there would make it a folder that is not an
    artifact), nor another artifact (a killed fit would leave its files there, and every
    later writer of that artifact would refuse it). ConfigError naming --checkpoint-dir
    (when given) and what is in the way."""
    if checkpoint is None:
        return
    option = "--checkpoint-dir " if given != "auto" else "the checkpoint directory "
    try:
        inside, artifact = checkpoint.resolve(), out.resolve()  # symbolic links followed
    except (RuntimeError, OSError) as exc:  # a loop of links, a directory that cannot be read
        raise ConfigError(
            f"{option}{checkpoint}: cannot follow it or --out to where it leads ({exc})"
        ) from None
    if inside == artifact or artifact in inside.parents:
        raise ConfigError(
            f"{option}{checkpoint} is --out or inside it: expected a directory beside the "
            "artifact (the default, auto, puts it at .OUT.checkpoint)"
        )
    for path in (inside, *inside.parents):
        if is_artifact(path):
            raise ConfigError(
                f"{option}{checkpoint} is an artifact or inside one ({path}): expected a "
                "directory of its own beside the artifact"
            )
    for path in (checkpoint, *checkpoint.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                what = "is" if path == checkpoint else f"is under {path}, which is"
                raise ConfigError(
                    f"{option}{checkpoint} {what} not a directory: expected a directory, or "
                    "a path where one can be made"
                )
            return


def fit_estimator(estimator: NCA, split, checkpoint: Path | None = None) -> list[str]:
    """Fit on the training split, validating on the validation split, with the fit's
    checkpoint in ``checkpoint``; returns the convergence warnings and a checkpoint that
    could not be written, printed to stderr when the fit returns (so a run that fails
    later has said them) and recorded in the artifact."""
    has_val = split.X_val.shape[0] > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            estimator.fit(
                split.X_train,
                split.y_train,
                X_val=split.X_val if has_val else None,
                y_val=split.y_val if has_val else None,
                checkpoint=checkpoint,
            )
        finally:
            progress = (estimator.options or {}).get("progress")  # with_options gave a dict
            if isinstance(progress, StageBar):
                progress.close()
    messages = [
        str(w.message)
        for w in caught
        if issubclass(w.category, ConvergenceWarning)
        or "converge" in str(w.message)
        or "checkpoint" in str(w.message)  # a checkpoint the disk refused
    ]
    for message in messages:
        print(f"WARNING: {message}", file=sys.stderr)
    return messages


@dataclass
class Evaluation:
    """The learned space scored with the rule the artifact will serve."""

    z_train: np.ndarray  # (n_train, d) float32: the reference set
    y_train: np.ndarray  # (n_train,) class indices of the references
    z_val: np.ndarray  # (n_val, d) float32
    y_val: np.ndarray  # (n_val,)
    z_test: np.ndarray  # (n_test, d) float32
    val_accuracy: dict  # k -> accuracy
    test_accuracy: dict  # k -> accuracy
    default_k: int  # the k with the best validation accuracy: the artifact's default
    test_predictions: np.ndarray  # (n_test,) class indices at default_k
    baselines: dict  # name -> accuracies (training.evaluation.baselines)
    train_digests: np.ndarray  # (n_train, 32) uint8: sha256 of each training row
    # training.evaluation.calibration.calibrate on the validation rows
    outlier_calibration: dict | None = None
    z_ref: np.ndarray | None = None  # (M, d) the references served: z_train or prototypes
    y_ref: np.ndarray | None = None  # (M,)
    ref_ids: np.ndarray | None = None  # (M,) prototypes: the training row nearest each
    nearest_reference: dict | None = None  # nearest_reference_distances(z_ref, z_val, z_test)
    # the vote served: --decision-rule, or chosen on validation among SERVED_VOTES ("soft@t":
    # the soft vote at temperature t, which the served map carries in its scale)
    vote: str = "majority"
    # {vote: {k: accuracy}} on validation, for each vote offered, when the vote was chosen
    val_accuracy_by_rule: dict | None = None
    # which curve chose the served (vote, k), on how many rows ("validation" or "cross-fitted"
    # with its folds and its {vote: {k: accuracy}}): training.evaluation.cross_fit
    k_choice: dict | None = None
    projection: np.ndarray | None = None  # (d, D) float32: the served map, sqrt(t) x the fit's
    offset: np.ndarray | None = None  # (d,) float32

    @property
    def rule(self) -> str:
        """The service's decision rule of the vote ("soft" for "soft@t")."""
        return parse_vote(self.vote)[0]

    @property
    def map_scale(self) -> float:
        """The float32 factor sqrt(t) by which the served map is the fitted one."""
        return float(served_map_factor(parse_vote(self.vote)[1]))


def served_map_factor(temperature: float) -> np.float32:
    """sqrt(t) in float32: the factor by which the job multiplies the fitted map (W and b)
    to serve the soft vote at temperature t as the service's soft rule."""
    return np.float32(np.sqrt(temperature))


BASELINES_SKIPPED = (
    "not computed in a data-parallel run: the baselines need every raw training row in one "
    "process, which no rank holds"
)


BASELINES_SKIPPED_SPARSE = (
    "not computed for sparse rows (the Euclidean one is): whitening, PCA, LDA and RCA centre "
    "the features or need their D x D covariance, which would densify them"
)


def sparse_baselines(split, vote: str) -> dict:
    """The baselines of a sparse split: kNN on the rows as they are (the sparse fit does not
    standardise them), on evenly spaced validation and test rows within
    BASELINE_SEARCH_BUDGET (a query costs about N times a row's non-zeros); the others
    skipped (BASELINES_SKIPPED_SPARSE)."""
    n_train = split.X_train.shape[0]
    per_row = max(1, split.X_train.nnz // max(1, n_train))  # non-zeros a row
    record = {"n_components": int(split.X_train.shape[1])}
    for part, X, y in (("val", split.X_val, split.y_val), ("test", split.X_test, split.y_test)):
        rows = baseline_rows(X.shape[0], n_train, per_row)
        record[f"{part}_accuracy"] = sparse_knn_accuracies(
            split.X_train, split.y_train, X[rows], y[rows], len(split.classes), K_VALUES, vote
        )
        record[f"{part}_rows"] = len(rows)
    return {"euclidean": record, "skipped": BASELINES_SKIPPED_SPARSE}


def evaluate(
    estimator: NCA, split, config: TrainConfig, group: ProcessGroup | None = None, log=print
) -> Evaluation | None:
    """Project every split, score kNN for each k in K_VALUES with each vote the artifact may
    serve (--decision-rule auto: ``SERVED_VOTES``, the majority vote and the soft vote at
    each of ``SOFT_TEMPERATURES``), choose the vote and the default k on validation or on
    cross-fitted votes (``training.evaluation.cross_fit``), and score the test rows and the
    baselines with that vote.

    The served map is the fitted one multiplied by sqrt(t), t the chosen soft vote's
    temperature (1 for the majority vote): the service's soft rule on it is the soft vote
    at t. Every split is projected by that map, as the service projects a query.

    Data-parallel: the ranks' projected training and validation rows (N x d: small), their
    labels and row digests are gathered; rank 0 scores them and chooses, every rank
    projects its rows again when the chosen map is another, and the other ranks return
    None."""
    group = group or ProcessGroup()

    def projected(W: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
        """(z_train, z_val, z_test) in the map (W, b); data-parallel, every rank's training
        and validation rows in rank order."""
        z_train, z_val, z_test = (
            (sparse_input.project if sp.issparse(x) else project)(x, W, b)
            for x in (split.X_train, split.X_val, split.X_test)
        )
        if group.is_distributed:
            z_train = gather_array(z_train, split.n_train, group)
            z_val = gather_array(z_val, split.n_val, group)
        return z_train, z_val, z_test

    W, b = estimator.projection_, estimator.offset_
    z_train, z_val, z_test = projected(W, b)
    y_train, y_val = split.y_train, split.y_val
    digests = row_digests(split.X_train)
    if group.is_distributed:
        y_train, y_val = (
            gather_array(y_train, split.n_train, group),
            gather_array(y_val, split.n_val, group),
        )
        digests = gather_array(digests, split.n_train, group)
    n_classes = len(split.classes)
    prototypes = getattr(estimator, "prototypes_", None)
    # "auto": the vote and k that serve the validation rows best (majority among equals)
    votes = SERVED_VOTES if config.decision_rule == "auto" else (config.decision_rule,)
    vote, default_k, k_choice, val_by_vote = None, None, None, None
    if group.rank == 0:
        z_ref, y_ref, k = z_train, y_train, config.k  # the references served
        if prototypes is not None:  # learned prototypes instead
            z_ref, y_ref, k = prototypes, estimator.prototype_labels_.astype(np.int64), 1
        val_by_vote = knn_accuracies_by_rule(z_ref, y_ref, z_val, y_val, n_classes, K_VALUES, votes)
        quiet = replace(config, quiet=True)  # the cross-fit's fits: no bar or table
        vote, default_k, k_choice = choose_served_k(
            lambda: build_estimator(quiet, split.X_train.shape[1]),
            split,
            # a data-parallel run, and learned prototypes (the references served), do not
            # cross-fit: their curve is the validation split's
            "0" if group.is_distributed or prototypes is not None else config.k_folds,
            config.seed,
            votes,
            val_by_vote,
            min(k, len(z_ref)),
            log,
        )
    # the served map: the vote's temperature t in its scale (every rank projects by it)
    temperature = agreed_value(parse_vote(vote)[1] if group.rank == 0 else 1.0, group)
    scale = served_map_factor(temperature)  # the served map over the fitted one
    if temperature != 1.0:
        W, b = W * scale, b * scale  # float32: as the artifact stores them
        z_train, z_val, z_test = projected(W, b)
    if group.rank != 0:
        return None
    rule = parse_vote(vote)[0]  # the service's rule on the served map
    z_ref, y_ref, ref_ids = z_train, y_train, None
    if prototypes is not None:  # the prototypes in the served map's scale
        z_ref, y_ref = prototypes * scale, estimator.prototype_labels_
        y_ref, ref_ids = y_ref.astype(np.int64), estimator.prototype_rows_
    test_acc = knn_accuracies(z_ref, y_ref, z_test, split.y_test, n_classes, K_VALUES, rule)
    predictions = knn_predictions(z_ref, y_ref, z_test, n_classes, (default_k,), rule)
    if group.is_distributed:
        baselines = {"skipped": BASELINES_SKIPPED}
    elif sp.issparse(split.X_train):
        baselines = sparse_baselines(split, vote)
    else:
        baselines = evaluate_baselines(
            split, estimator.mean_, estimator.scale_, estimator.n_components, vote
        )
    return Evaluation(
        z_train,
        y_train,
        z_val,
        y_val,
        z_test,
        val_by_vote[vote],
        test_acc,
        default_k,
        predictions[default_k],
        baselines,
        digests,
        calibrate(z_ref, z_val),
        z_ref,
        y_ref,
        ref_ids,
        nearest_reference_distances(z_ref, z_val, z_test),
        vote=vote,
        val_accuracy_by_rule=val_by_vote if len(votes) > 1 else None,
        k_choice=k_choice,
        projection=W,
        offset=b,
    )


def training_record_of(config: TrainConfig, estimator: NCA, warns: list[str]) -> dict:
    """What the fit did: the plan, where it stopped, how long it took, what it warned."""
    return {
        "objective": config.objective,
        "k": config.k,
        "solver": estimator.solver_,
        "n_candidates": estimator.n_candidates_,
        "l2": estimator.l2_,
        "exact_finish_iter": int(estimator.exact_finish_iter_),
        "plan": estimator.plan_.describe(),  # every "auto" as the fit resolved it
        "init": estimator.init_used_,
        "standardization": estimator.standardization_,
        "standardization_scores": estimator.standardization_scores_,
        "seed": config.seed,
        "device": estimator.device_,
        "world_size": int(estimator.world_size_),
        "kernels": estimator.kernels_,
        "distributed_backend": estimator.distributed_backend_,
        "converged": bool(estimator.converged_),
        "stop_reason": estimator.stop_reason_,
        "n_iter": int(estimator.n_iter_),
        "final_objective": float(estimator.objective_value_),
        "best_val_accuracy": estimator.best_val_accuracy_,
        "kept_iteration": int(estimator.kept_iteration_),  # 0: the initial map
        "fit_seconds": float(estimator.fit_seconds_),
        "max_seconds": config.max_seconds,
        "budget_exhausted": bool(estimator.budget_exhausted_),
        "init_scale": float(estimator.init_scale_),
        # per stage: seconds, evaluations, refreshes, held-out scores at its start and end
        "stages": estimator.stages_,
        "stage_measure": estimator.stage_measure_,
        **peak_memory_mib(estimator.device_),
        "warnings": warns,
        # candidate mode: the exact objective on a sample disagreed with the candidate one
        "candidate_warning": getattr(estimator, "candidate_warning_", None),
        "config": config.to_dict(),
    }


# validation rows nearer the references than this fraction of the test rows' distance (the
# medians) are flagged: near-copies across the split make the validation curve over k
# favour small k (a row's near-copy is its 1-NN) where unseen rows have none
NEAR_COPY_RATIO = 0.8


def nearest_reference_distances(
    z_ref: np.ndarray, z_val: np.ndarray, z_test: np.ndarray
) -> dict | None:
    """How far the validation and the test rows sit from their nearest reference: the
    median Euclidean distance of each split to its nearest reference, and their ratio
    (validation / test).

    The served k is chosen on the validation rows; it is the best k for unseen rows only
    when those rows are as far from the references as unseen rows are (a ratio near 1).

    z_ref (M, d), z_val (n_val, d), z_test (n_test, d). None when either split is empty;
    the ratio is None when the test rows' median distance is 0. The nearest reference is
    ``nearest_references``' (FAISS's or torch's pass, re-ranked in float64): the answer of
    ``service.core.knn.exact_knn``, found faster
    (benchmarks/README.md, "A forward pass without the gradient")."""
    if len(z_val) == 0 or len(z_test) == 0:
        return None
    medians = {
        name: float(np.median(np.sqrt(np.maximum(nearest_references(z, z_ref, 1)[0][:, 0], 0.0))))
        for name, z in (("validation", z_val), ("test", z_test))
    }
    # None when the test rows themselves are references (their median distance is 0)
    ratio = medians["validation"] / medians["test"] if medians["test"] > 0 else None
    return {
        "validation_median": medians["validation"],
        "test_median": medians["test"],
        "ratio": ratio,
        "near_copies": ratio is not None and ratio < NEAR_COPY_RATIO,
    }


def served_vote_record(ev: Evaluation) -> dict:
    """What report.json's metrics say of the vote served: ``vote`` ("soft@t": the soft vote
    at temperature t) and ``map_scale`` (the factor sqrt(t) the artifact's map carries over
    the fitted one, which a warm start divides out) always; with --decision-rule auto also
    the service's ``decision_rule``, the votes offered in the order ties go
    (``votes_offered``: report.json sorts its keys) and their validation curves
    (``val_accuracy_by_rule``, keyed by vote)."""
    record = {"vote": ev.vote, "map_scale": ev.map_scale}
    if ev.val_accuracy_by_rule is not None:  # --decision-rule auto: what it chose among
        record["decision_rule"] = ev.rule
        record["votes_offered"] = list(ev.val_accuracy_by_rule)
        record["val_accuracy_by_rule"] = ev.val_accuracy_by_rule
    return record


def build_report(
    config: TrainConfig, data_name: str, split, estimator: NCA, ev: Evaluation, warns: list[str]
) -> dict:
    """report.json: data, training record (with the history), metrics, test predictions."""
    training_record = training_record_of(config, estimator, warns)
    metrics = {
        "val_accuracy": ev.val_accuracy,
        "test_accuracy": ev.test_accuracy,
        "default_k": ev.default_k,
        "val_accuracy_at_default_k": ev.val_accuracy.get(ev.default_k),
        # the curve the served k and vote were chosen on: the validation split's, or the
        # cross-fitted one (training.evaluation.cross_fit)
        "k_choice": ev.k_choice,
        "test_accuracy_at_default_k": ev.test_accuracy.get(ev.default_k),
        "baselines": ev.baselines,
        # how far validation and test rows sit from their nearest reference (the served k is
        # chosen on validation: it holds for unseen rows when the ratio is near 1)
        "nearest_reference_distance": ev.nearest_reference,
        # test points farther from every reference than the calibrated 0.99-quantile
        "outliers": outlier_report(
            ev.outlier_calibration,
            ev.z_ref,
            ev.y_ref,
            ev.z_test,
            split.y_test,
            len(split.classes),
            ev.default_k,
            ev.rule,
        ),
    }
    metrics.update(served_vote_record(ev))
    data_record = {
        "name": data_name,
        "source": config.data,
        "fingerprint_sha256": fingerprint_from_row_digests(
            ev.train_digests, split.classes[ev.y_train]
        ),
        "n_train": len(ev.y_train),
        "n_val": len(ev.y_val),
        "n_test": int(split.X_test.shape[0]),
        "n_features": int(split.X_train.shape[1]),
    }
    return {
        "data": data_record,
        "training": {**training_record, "history": estimator.history_},
        "metrics": metrics,
        "test_predictions": {
            "k": ev.default_k,
            "rule": ev.rule,
            "class_index": ev.test_predictions.tolist(),
            "label": split.classes[ev.test_predictions].tolist(),
            "true_class_index": split.y_test.tolist(),
        },
    }


def save_artifact(
    out: Path, config: TrainConfig, data_name: str, split, estimator: NCA, ev: Evaluation, report
) -> None:
    """The artifact (service.core.artifact), with report.json and the plots as extra files; the
    manifest carries the report without its per-iteration history and test predictions."""
    extra_files = {"report.json": json_bytes(report)}
    if config.plots:
        extra_files["objective.png"] = plot_objective(estimator.history_, config.objective)
    if config.plots and len(ev.z_test):  # no test rows: no picture of them
        extra_files["embedding_test.png"] = plot_embedding(
            ev.z_test,
            split.y_test,
            split.classes.tolist(),
            f"{data_name}: test embeddings (d={estimator.n_components})",
        )
    training_record = {k: v for k, v in report["training"].items() if k != "history"}
    with writing("the artifact", out):  # a full or read-only disk: path and cause, exit 2
        write_artifact(
            out,
            projection=ev.projection,
            offset=ev.offset,
            embeddings=ev.z_ref,
            labels=ev.y_ref.astype(np.int32),
            ids=ev.ref_ids,
            classes=split.classes.tolist(),
            mean=estimator.mean_,
            scale=estimator.scale_,
            default_k=ev.default_k,
            decision_rule=ev.rule,
            validation_embeddings=ev.z_val,
            validation_labels=ev.y_val.astype(np.int32),
            extra_files=extra_files,
            metadata={
                "training": training_record,
                "metrics": report["metrics"],
                "data": report["data"],
                "outlier_calibration": ev.outlier_calibration,
                **_reference_set_of(estimator, config),
            },
        )


def _reference_set_of(estimator: NCA, config: TrainConfig) -> dict:
    """{"reference_set": ...} when the artifact serves learned prototypes, else {}."""
    fit = getattr(estimator, "prototype_fit_", None)
    if estimator.prototypes_ is None or fit is None:
        return {}
    record = reference_set_record(
        method="nca, learned jointly with the map",
        reduction=float(config.prototypes),
        compressed=fit,
    )
    return {"reference_set": record}


__all__ = ["run"]
