"""``python -m training references {add,remove,condense} ...``: reference-set changes.

Each command writes a new artifact version at ``--out`` (atomically) and, with
``--publish LINK``, repoints that symlink at it afterwards, as the training job does. It prints
a JSON summary on stdout; bad input, and output that cannot be written (a full or read-only
disk, the file-size limit), exit 2 with one line on stderr naming the path and the cause, and
replace nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from service.core.artifact import ArtifactError, OutputClaim, writer_lock
from service.core.artifact.ownership import check_lock_usable, check_writable
from training.data.datasets import (
    DataError,
    check_regular_file,
    default_memory_budget,
    load_dataset,
)
from training.errors import (
    ConfigError,
    Interrupted,
    OneLineParser,
    check_lock_timeout,
    check_seed,
    describe_os_error,
    interrupted_line,
    print_output,
    raise_on_file_size_limit,
    raise_on_interrupt,
    writing,
)
from training.publish import check_publish_link, publish
from training.references.versions import (
    PROTOTYPE_REFINERS,
    ReferenceError,
    add_references,
    condense_references,
    remove_references,
)
from training.state_file import checkpoint_beside


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m training references",
        description="Add, remove or condense the references of a trained model without retraining.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="project new labelled rows and append them")
    add.add_argument("--model", required=True, help="the artifact directory to start from")
    add.add_argument(
        "--data", required=True, help="the new rows: .npz (X, y), .npy with --labels, or .csv"
    )
    add.add_argument("--labels", help="label file (.npy) when --data is a .npy feature file")
    add.add_argument(
        "--label-column",
        help="CSV label column by name (default: 'label', else the last) or position (-1 the last)",
    )
    add.add_argument(
        "--ids",
        help="ids of the new rows: a .npy file of int64, or a text file with one per line "
        "(default: counting on from the largest id)",
    )
    remove = commands.add_parser("remove", help="drop the references with the given ids")
    remove.add_argument("--model", required=True, help="the artifact directory to start from")
    remove.add_argument("--ids", nargs="+", default=[], help="ids to remove")
    remove.add_argument(
        "--ids-file", help="a .npy file of int64 ids, or a text file with one id per line"
    )
    condense = commands.add_parser(
        "condense",
        help="shrink the reference set: keep the references the k-NN decision needs (Hart "
        "condensing, Wilson editing) or replace them by learned prototypes (--method)",
    )
    add_condense_options(condense)
    for command in (add, remove, condense):
        command.add_argument("--out", required=True, help="where to write the new version")
        command.add_argument("--publish", help="symlink to repoint at --out afterwards")
        command.add_argument(
            "--lock-timeout",
            type=seconds,
            default=None,
            help="seconds to wait, in all, for other writers of --publish and of --out before "
            "giving up with nothing written (default or 'none': as long as it takes)",
        )
    return parser


def add_condense_options(condense: argparse.ArgumentParser) -> None:
    """The options of ``references condense``."""
    condense.add_argument("--model", required=True, help="the artifact directory to start from")
    condense.add_argument(
        "--check-k",
        type=int,
        help="a removed reference must have this many nearest kept references, all of its "
        "label (default: the model's default k + 2)",
    )
    condense.add_argument(
        "--edit-k", type=int, default=0, help="Wilson editing with this k first (0: none)"
    )
    condense.add_argument(
        "--method",
        choices=("hart", "prototypes"),
        default="hart",
        help="hart: keep a subset (Hart's condensing, Wilson editing); prototypes: replace "
        "the references by prototypes learned with NCA's objective (see --refine)",
    )
    condense.add_argument(
        "--reduction",
        type=float,
        help="prototypes: training rows per prototype, above 1 (default 20: 5%% kept); the "
        "budget round(N / reduction) is shared in proportion to the classes' sizes, a class "
        "below its share keeping one prototype",
    )
    condense.add_argument(
        "--min-per-class",
        type=int,
        default=None,
        help="prototypes: at least this many prototypes per class (or all its rows), the "
        "rest shared by size (default 1); a class of a few separate clusters needs a few",
    )
    condense.add_argument(
        "--refine",
        choices=PROTOTYPE_REFINERS,
        help="prototypes: how they move from the per-class k-means centres: nca (default) "
        "learns them with NCA's objective, the map fixed; none keeps the cluster means",
    )
    condense.add_argument(
        "--refine-epochs",
        type=int,
        help="prototypes: at most this many L-BFGS iterations (nca, default 200)",
    )
    condense.add_argument(
        "--seed", type=int, default=0, help="the order of the passes / the k-means seeding"
    )
    condense.add_argument(
        "--data",
        help="a labelled test set (raw inputs) to report accuracy before and after on; from "
        "an .npz, its X_test and y_test when it has them",
    )
    condense.add_argument("--labels", help="label file (.npy) when --data is a .npy file")
    condense.add_argument(
        "--label-column", help="CSV label column by name or position (-1 the last)"
    )


INT64 = np.iinfo(np.int64)
DECIMAL = re.compile(r"[+-]?[0-9]+", re.ASCII)


def _ids_from_text(values: list[str], what: str) -> np.ndarray:
    """Ids written as decimal integers, as int64 (n,); the first that is not an integer, or
    is beyond int64's range, is named."""
    ids = []
    for value in values:
        if not DECIMAL.fullmatch(value.strip()):  # int() also takes "1_0" and other scripts' digits
            raise ReferenceError(f"{what}: ids must be integers, got {value!r}")
        number = int(value.strip(), 10)
        if not INT64.min <= number <= INT64.max:
            raise ReferenceError(
                f"{what}: id {value.strip()} is beyond the 64-bit integer range "
                f"[{INT64.min}, {INT64.max}]"
            )
        ids.append(number)
    return np.array(ids, dtype=np.int64)


def _ids_array(ids: np.ndarray, what: str) -> np.ndarray:
    """An ids array read from a file as int64 (n,): 1-D, integers, within int64's range."""
    if ids.ndim != 1:
        raise ReferenceError(f"{what}: expected a 1-D array of ids, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ReferenceError(f"{what}: ids must be integers, got dtype {ids.dtype}")
    if ids.dtype.kind == "u" and ids.size and ids.max() > INT64.max:
        raise ReferenceError(
            f"{what}: id {ids.max()} is beyond the 64-bit integer range [{INT64.min}, {INT64.max}]"
        )
    return ids.astype(np.int64)


def _ids_file(path: str, option: str = "--ids-file") -> np.ndarray:
    file = Path(path)
    try:
        check_regular_file(file, option)
    except DataError as exc:
        raise ReferenceError(str(exc)) from None
    if file.suffix == ".npy":
        try:
            ids = np.load(file, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ReferenceError(f"{option} {path!r}: not a readable .npy file ({exc})") from exc
        return _ids_array(ids, f"{option} {path!r}")
    try:  # utf-8-sig: a byte-order mark is read as such
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ReferenceError(
            f"{option} {path!r}: not UTF-8 text (byte {exc.start}); expected one id per line"
        ) from None
    except OSError as exc:  # a read error (EIO) names no file: the option and path do
        cause = describe_os_error(OSError(exc.errno, exc.strerror))
        raise ReferenceError(f"{option} {path!r}: cannot be read ({cause})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return _ids_from_text(lines, f"{option} {path!r}")


def run(args: argparse.Namespace) -> dict:
    """Check the options, then make the change in ``--out``'s turn (``OutputClaim``): writers
    of one ``--out`` take turns, an edit in place reads the version the writer before it
    wrote, and an ``--out`` another writer replaced since this command started is not
    replaced again. With ``--publish``, commands publishing one link take turns as well."""
    check_lock_timeout(args.lock_timeout)
    check_publish_link(args.publish, args.out)
    if args.command == "condense":
        check_seed(args.seed)  # before the wait for --out's turn
    try:
        claim = OutputClaim(args.out)
        if args.publish:  # the link's directory and its lock, before any work
            with writing("the --publish link", Path(args.publish).absolute()):
                check_writable(args.publish)
            check_lock_usable(args.publish)
    except ArtifactError as exc:
        raise ReferenceError(str(exc)) from None
    # with --publish, edits through one link take turns too (its lock first, then --out's):
    # each reads --model after the one before it published, so none is dropped
    timeout = args.lock_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    publishing = (
        writer_lock(args.publish, timeout=timeout) if args.publish else contextlib.nullcontext()
    )
    with publishing:
        # --out's turn within what is left of the one bound (both waits together)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with claim.turn(source=args.model, timeout=left):
            return _change(args)


def seconds(text: str) -> float | None:
    """--lock-timeout's value: a number of seconds, or 'none' (wait as long as it takes)."""
    return None if text.strip().lower() == "none" else float(text)


def _data(args: argparse.Namespace):
    """The rows of --data (with --labels / --label-column), as the training job reads them."""
    return load_dataset(
        args.data,
        labels=args.labels,
        label_column=args.label_column,
        memory_budget=default_memory_budget(),
    )


def _change(args: argparse.Namespace) -> dict:
    if args.command == "add":
        data = _data(args)
        ids = None if args.ids is None else _ids_file(args.ids, "--ids")
        summary = add_references(args.model, data.X, data.y, out=args.out, ids=ids)
    elif args.command == "condense":
        X_test = y_test = None
        if args.data:
            data = _data(args)
            # an .npz with a test split (X_test, y_test) is scored on that split
            if data.X_test is not None:
                X_test, y_test = data.X_test, data.y_test
            else:
                X_test, y_test = data.X, data.y
        summary = condense_references(
            args.model,
            out=args.out,
            method=args.method,
            check_k=args.check_k,
            edit_k=args.edit_k,
            reduction=args.reduction,
            refine=args.refine,
            refine_epochs=args.refine_epochs,
            seed=args.seed,
            X_test=X_test,
            y_test=y_test,
            min_per_class=args.min_per_class,
            checkpoint_dir=checkpoint_beside(args.out),
        )
    else:
        ids = _ids_from_text(args.ids, "--ids")
        if args.ids_file:
            ids = np.concatenate([ids, np.asarray(_ids_file(args.ids_file))])
        summary = remove_references(args.model, ids, out=args.out)
    if args.publish:
        publish(args.publish, Path(summary["artifact"]))
        summary["published"] = args.publish
    return summary


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as the training job prints one: one line on stderr, no source line."""
    print(f"WARNING: {message}", file=sys.stderr)


def main(argv: list[str]) -> int:
    """Run one command: exit status 0 and the summary, or 2 and one line on stderr (also
    when the summary cannot be written to stdout: the line then says where the new version
    was written)."""
    raise_on_file_size_limit()
    raise_on_interrupt()
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():  # restores showwarning after the command
            warnings.showwarning = _one_line_warning
            summary = run(args)
    except Interrupted as exc:  # SIGINT or SIGTERM: one line, no traceback
        checkpoint = checkpoint_beside(args.out) if args.command == "condense" else None
        line = interrupted_line(exc, time.perf_counter() - started, args.out, checkpoint)
        print(f"error: {line}", file=sys.stderr)
        return exc.exit_status
    except (ReferenceError, DataError, ConfigError, ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # ValueError: a checkpoint it cannot use
        return 2
    except OSError as exc:  # a full or read-only disk, the file-size limit: path and cause
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    failed = print_output(json.dumps(summary, indent=2))
    if failed is not None:  # the version was written (and published): say where
        published = f", published at {summary['published']}" if "published" in summary else ""
        print(
            f"error: cannot write the summary to standard output: {describe_os_error(failed)}; "
            f"the new version was written at {summary['artifact']}{published}",
            file=sys.stderr,
        )
        return 2
    return 0
