"""The one configuration object of a training run, and the CLI built from it.

Every field of :class:`TrainConfig` is a command-line option (``n_components`` ->
``--n-components``) whose help text is the field's ``help`` metadata, so the CLI, the
manifest's record of the run and the defaults cannot drift apart.

A setting the estimator also has takes its default from ``training.NCA``'s signature (the
one definition), except where the job deliberately differs; ``JOB_DEFAULTS`` lists those
differences with their reasons, and a test holds every other default equal to the estimator's.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import MISSING, asdict, dataclass, field, fields

from service.core.vocabulary import NEIGHBOUR_RULES, DecisionRule
from training.errors import ConfigError, OneLineParser
from training.model import parameters
from training.model.estimator import NCA
from training.model.options import OPTION_NAMES, FitOptions, fit_settings, with_options
from training.model.preparation import resolve_device
from training.progress import progress_mode

# the estimator's defaults by setting name: its constructor's and its options' (FitOptions)
ESTIMATOR_DEFAULTS = {
    **{
        name: parameter.default
        for name, parameter in inspect.signature(NCA.__init__).parameters.items()
        if name not in ("self", "options")
    },
    **{f.name: f.default for f in fields(FitOptions)},
}

# Where the job's default deliberately differs from the estimator's, and why.
JOB_DEFAULTS = {
    # None means min(32, D) here (a servable artifact wants d << D), D in the estimator
    "n_components": None,
    # the job holds out a validation split anyway; keeping the best map costs nothing
    "early_stopping": True,
}


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


def _shared(name: str, help: str):
    """A setting the estimator has too: its default comes from the estimator."""
    default = JOB_DEFAULTS.get(name, ESTIMATOR_DEFAULTS[name])
    return field(default=default, metadata={"help": help, "estimator": name})


def _integer(value) -> int:
    """int(value), but not of a bool or a float (2.5 is no count of iterations)."""
    if isinstance(value, (bool, float)):
        raise ValueError(value)
    return int(value)


# The estimator's settings the command line gives as text: each one's words (None: as the
# job's default), how a number is read, and what the message says the option takes. A number's
# bounds are the estimator's (``training.model.parameters.CONSTRAINTS``).
AUTO_WORDS = {None: "auto", "auto": "auto"}
TEXT_SETTINGS = {
    "n_candidates": (
        {**AUTO_WORDS, "exact": None, "none": None, "None": None},
        int,
        "'auto', 'exact' or an integer >= 1",
    ),
    "l2": (AUTO_WORDS, float, "'auto' or a number in [0, 1e6]"),
    "exact_finish": (AUTO_WORDS, _integer, "'auto' or an integer >= 0"),
    "max_seconds": ({None: None}, float, "a number of seconds > 0, or none"),
    "init_scale": (AUTO_WORDS, float, "'auto' or a number in [1e-06, 1e+06]"),
}


def parse_setting(name: str, value):
    """The estimator's value of the setting ``name`` (a row of TEXT_SETTINGS) given as
    ``value``: one of its words, or a number the estimator accepts; ConfigError naming the
    option, the value and what the option takes."""
    words, number, accepted = TEXT_SETTINGS[name]
    if (value is None or isinstance(value, str)) and value in words:
        return words[value]
    try:
        parsed = number(value)
    except (TypeError, ValueError, OverflowError):
        parsed = float("nan")  # no constraint accepts it
    if not any(c.accepts(parsed) for c in parameters.CONSTRAINTS[name]):
        raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be {accepted}")
    return parsed


@dataclass
class TrainConfig:
    data: str = _opt(
        "digits",
        "built-in set (digits, iris, wine, breast_cancer) or a .npz / .npy / .csv / .parquet "
        "path; a sparse matrix saved by scipy.sparse.save_npz is fitted without densifying it",
    )
    labels: str | None = _opt(
        None, "label file (.npy) when --data is a .npy feature file or a sparse .npz"
    )
    label_column: str | None = _opt(
        None,
        "CSV or Parquet label column by name ('label' if present, else the last); in a CSV "
        "also by position (0 the first, -1 the last)",
    )
    out: str | None = _opt(
        None,
        "artifact directory to write (default: models/<data name>); '{timestamp}' in it becomes the UTC time",
    )
    checkpoint_dir: str = _opt(
        "auto",
        "where the fit's state is written at each stage's end, so that the same command run "
        "again after a kill resumes there: auto is .OUT.checkpoint beside --out; a directory "
        "given keeps its other files; the fit's files are removed once the artifact is "
        "written; none writes none",
    )
    publish: str | None = _opt(
        None,
        "after writing, atomically point this symlink at the new artifact (e.g. /models/current)",
    )
    memory_budget_gib: float | None = _opt(
        None,
        "GiB the features may take as float64, checked from the data file's header after "
        "its labels and before its values are read (default: 80%% of the memory available "
        "when the job starts)",
    )
    lock_timeout: float | None = _opt(
        None,
        "seconds to wait for another writer of --out to finish before giving up with nothing "
        "written (default or 'none': as long as it takes; a writer stopped with SIGSTOP "
        "holds its lock until continued)",
    )
    n_components: int | None = _shared(
        "n_components", "embedding dimension d (default: min(32, D))"
    )
    objective: str = _shared(
        "objective",
        "nca (expected number correct, f) or nca-log (log-likelihood, g); knca-majority, "
        "knca-all (kNCA: the exact expected accuracy of a --k vote won outright, or with all "
        "k neighbours agreeing) and their -log forms",
    )
    k: int = _shared("k", "k of the kNN rule the objective trains for (1 for NCA)")
    transformation: str = _shared("transformation", "linear (full or low-rank d x D) or diagonal")
    init: str = _shared(
        "init", "auto, pca, lda, identity, random, or an artifact directory (warm start)"
    )
    solver: str = _shared("solver", "auto (L-BFGS), lbfgs, or adam (mini-batches)")
    max_iter: int = _shared("max_iter", "L-BFGS iterations or Adam epochs")
    tol: float = _shared("tol", "convergence tolerance")
    l2: str = _shared(
        "l2",
        "L2 penalty on A (added to the mean per-point loss): a number in [0, 1e6], or auto "
        "(0.03 on the exact objective, chosen by cross-validation; 0 on candidate sets)",
    )
    n_candidates: str = _shared(
        "n_candidates",
        "exact (all points), auto, or K: K nearest same- and other-class candidates per point",
    )
    refresh_every: int = _shared(
        "refresh_every", "at most this many iterations between candidate refreshes"
    )
    refresh_tol: float | None = _shared(
        "refresh_tol",
        "refresh candidates when the neighbour mass inside them falls by this fraction",
    )
    candidate_mass: float | None = _shared(
        "candidate_mass",
        "grow K (up to 8x) until fresh candidates hold this fraction of the neighbour mass",
    )
    exact_finish: str = _shared(
        "exact_finish",
        "after candidate sets, this many L-BFGS iterations on the exact objective (at most "
        "65,536 query rows for nca/nca-log, among an evenly spaced sample of 65,536 points "
        "above that many, 2,048 rows among every point for knca-*): auto (5 "
        "for nca/nca-log, 20 for knca-*, 0 with adam), or an integer >= 0",
    )
    candidate_search: str = _shared(
        "candidate_search",
        "how candidate sets are found: auto (an IVF index from 50,000 points on the CPU, "
        "exact below), exact, or ivf",
    )
    init_scale: str = _shared(
        "init_scale",
        "factor on the initial map: auto (the scale that maximises NCA's log-likelihood of "
        "the initial map) or a number in [1e-6, 1e6] (1: the map as built)",
    )
    max_seconds: float | None = _shared(
        "max_seconds",
        "the fit's budget in seconds: when spent, the running stage stops, later stages are "
        "skipped and the best judged map is kept (the report says so); each of --k-folds' "
        "cross-fitted fits has the same budget; none: no budget",
    )
    stop_stalled_stages: bool = _shared(
        "stop_stalled_stages",
        "stop a stage after two held-out checks in a row without a gain "
        "(--no-stop-stalled-stages: every stage runs its iterations, unless early stopping, "
        "on by default, stops the fit first: add --no-early-stopping)",
    )
    select_stages: bool = _shared(
        "select_stages",
        "keep each stage's end only when it scores at least as well as its start on the "
        "validation split (or on left-out training rows); false keeps the optimiser's result",
    )
    standardize: str = _shared(
        "standardize",
        "auto (per-feature or one shared scale, whichever kNN on the inputs prefers), "
        "feature, global or none",
    )
    chunk_size: int | None = _shared(
        "chunk_size", "query rows per chunk (default: sized to a 256 MiB working set)"
    )
    batch_size: int = _shared("batch_size", "Adam mini-batch size (query rows)")
    learning_rate: float = _shared("learning_rate", "Adam step size")
    early_stopping: bool = _shared(
        "early_stopping",
        "stop when validation kNN accuracy stops improving (the report's stop reason: "
        "stalled); --no-early-stopping: the fit runs until its other rules stop it",
    )
    n_iter_no_change: int = _shared(
        "n_iter_no_change", "early stopping patience, in validation checks"
    )
    validation_interval: int = _shared(
        "validation_interval", "iterations between validation checks"
    )
    prototypes: float | None = _shared(
        "prototypes",
        "learned reference set: after the fit, learn round(N / PROTOTYPES) prototypes, shared "
        "in proportion to the classes' sizes (one at least), together with the map (NCA's "
        "objective) and serve them instead of the training rows (e.g. 20 keeps 5%%; above 1)",
    )
    test_size: float = _opt(
        0.2, "fraction of each class held out for testing (ignored if the data has a test set)"
    )
    val_size: float = _opt(0.1, "fraction of each class held out for validation")
    seed: int = _opt(0, "random seed (split, init, mini-batches)")
    device: str = _shared("device", "auto (CUDA when available), cpu, cuda, cuda:N")
    decision_rule: str = _opt(
        "auto",
        f"default decision rule in the artifact: {' or '.join(NEIGHBOUR_RULES)}, or auto (the "
        "vote, with the k, that scores best on the validation split, or on cross-fitted votes "
        "(--k-folds), among majority and soft at a temperature t of 1, 0.5 or 0.25, the "
        "earlier among equals; soft at t is served on the map multiplied by sqrt(t)); "
        "soft_prior is chosen per request",
    )
    k_folds: str = _opt(
        "auto",
        "how the served k and vote are chosen: N >= 2 cross-fits N maps on the training and "
        "validation rows and chooses on their out-of-fold votes; 0 chooses on the validation "
        "split; auto cross-fits 5 folds when the validation split has under 1,000 rows and "
        "the two splits at most 20,000 (training.evaluation.cross_fit)",
    )
    plots: bool = _opt(True, "write PNG plots beside the artifact")
    progress: str = _opt(
        "auto",
        "how the fit shows its progress: auto (a bar per stage when stderr is a terminal, "
        "else the per-iteration table), bar, table or none",
    )
    quiet: bool = _opt(False, "no progress bar and no per-iteration table")

    def estimator_params(self, n_features: int) -> dict:
        """The estimator's parameters for a run on ``n_features`` inputs: every setting
        tagged as the estimator's (parsed where the command line gives text), d = min(32, D)
        when no --n-components is given, and the job's own settings under the estimator's
        names (seed -> random_state, decision_rule -> validation_rule, the per-iteration table
        -> verbose: ``training.progress.progress_mode``).
        ConfigError for a value the estimator cannot take from the command line."""
        if self.decision_rule not in (*NEIGHBOUR_RULES, "auto"):
            raise ConfigError(
                f"--decision-rule={self.decision_rule!r} must be one of "
                f"{[*NEIGHBOUR_RULES, 'auto']} (soft_prior needs the outlier calibration made "
                "after training: ask for it per request; a soft vote at a temperature is "
                "chosen by auto)"
            )
        params = {}
        for f in fields(self):
            name = f.metadata.get("estimator")
            if name in TEXT_SETTINGS:
                params[name] = parse_setting(name, getattr(self, f.name))
            elif name is not None:
                params[name] = getattr(self, f.name)
        if params["n_components"] is None:
            params["n_components"] = min(32, n_features)
        params.update(
            # a validation split is scored with the served rule; "auto" chooses it after
            # the fit, so the fit scores with majority
            validation_rule=(
                DecisionRule.MAJORITY.value if self.decision_rule == "auto" else self.decision_rule
            ),
            random_state=self.seed,
            verbose=int(progress_mode(self.progress, self.quiet) == "table"),
        )
        return params

    def check_estimator_settings(self) -> None:
        """The estimator's settings checked before any data is read, each against the
        estimator's table (``training.model.parameters``), the device against this machine and
        ``--init`` as a name or a directory: ConfigError naming the option, the value given
        and what it accepts. The checks that need the data (d <= D, k < N) come after the read,
        still before the fit (``check_against_features``)."""
        params = self.estimator_params(n_features=1)  # d itself: checked against D after the read
        if self.n_components is not None and not parameters.Integer(1).accepts(
            params["n_components"]
        ):
            raise ConfigError(f"--n-components={self.n_components!r} must be an integer >= 1")
        settings = vars(fit_settings(NCA(**with_options(params)).get_params()))
        found = parameters.violation(settings)
        if found is not None:
            name, value, accepted = found
            option = self._option_of(name)
            given = getattr(self, option[2:].replace("-", "_")) if option[2:] else value
            raise ConfigError(f"{option}={given!r} must be {accepted}")
        for name, check in (("init", parameters.check_init_name), ("device", resolve_device)):
            try:
                check(settings[name])
            except ValueError as exc:
                raise ConfigError(f"--{exc}") from None

    def check_against_features(self, n_features: int) -> None:
        """--n-components within the data's D (read from the data, before the fit):
        ConfigError naming both."""
        d = self.estimator_params(n_features)["n_components"]
        if d > n_features:
            raise ConfigError(
                f"--n-components={self.n_components!r} must be at most the data's number of "
                f"features, D = {n_features}"
            )

    def _option_of(self, estimator_name: str) -> str:
        """The command line's option for an estimator setting (``--max-iter``); ``--`` alone
        when no option sets it."""
        for f in fields(self):
            if f.metadata.get("estimator") == estimator_name:
                return "--" + f.name.replace("_", "-")
        return "--"

    def to_dict(self) -> dict:
        return asdict(self)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already names its default
    or the default is None (an option that is off, or chosen from the data)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser(show_advanced: bool = False) -> argparse.ArgumentParser:
    """The job's parser. The estimator's advanced settings (``FitOptions``' fields but
    --prototypes) are accepted always and listed only by ``--help-advanced``."""
    parser = OneLineParser(
        prog="python -m training",
        description=(
            "Learn a linear map A by NCA on a labelled data set, evaluate kNN in the learned "
            "space against baselines, and write a servable artifact (plus report.json and plots)."
        ),
        formatter_class=_DefaultsFormatter,
    )
    commands = parser.add_subparsers(
        dest="command",
        title="commands",
        description="without a command, train; with one, work on a trained model",
    )
    references = commands.add_parser(
        "references",
        help="add, remove or condense the references of a trained model: "
        "python -m training references {add,remove,condense} --help",
        add_help=False,
    )
    references.add_argument("arguments", nargs=argparse.REMAINDER)
    report = commands.add_parser(
        "report",
        help="write report.html for a trained model from its report.json and plots: "
        "python -m training report MODEL_DIR",
        description="Render MODEL_DIR/report.html (a temporary file, then a rename) from the "
        "artifact's manifest, report.json and plots.",
    )
    report.add_argument("model_dir", help="an artifact directory written by python -m training")
    parser.add_argument(
        "--help-advanced",
        action=_AdvancedHelp,
        nargs=0,
        default=argparse.SUPPRESS,  # not a setting: never in the parsed namespace
        help="list the advanced fit settings too (training.model.options.FitOptions) and exit",
    )
    advanced = parser.add_argument_group(
        "advanced fit settings (training.model.options.FitOptions: what each default costs "
        "is measured in benchmarks/README.md)"
    )
    for f in fields(TrainConfig):
        is_advanced = f.metadata.get("estimator") in ADVANCED_OPTIONS
        group = advanced if is_advanced else parser
        help_text = f.metadata["help"] if show_advanced or not is_advanced else argparse.SUPPRESS
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if isinstance(default, bool):
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0].replace("'", ""), str)
        if kind is not str and "None" in str(f.type):
            kind = _or_none(kind)
        group.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text)
    return parser


# FitOptions' fields the job's --help leaves to --help-advanced (--prototypes, a feature of
# the job's own, stays in --help)
ADVANCED_OPTIONS = frozenset(OPTION_NAMES) - {"prototypes"}


class _AdvancedHelp(argparse.Action):
    """--help-advanced: the help with the advanced settings listed, then exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        build_parser(show_advanced=True).print_help()
        parser.exit()


def _or_none(kind):
    """An argparse type for an optional number: the number, or 'none' for None."""

    def parse(text: str):
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


@dataclass(frozen=True)
class ReportCommand:
    """``python -m training report MODEL_DIR``."""

    model_dir: str


def parse_command(argv: list[str] | None = None) -> TrainConfig | ReportCommand | list[str]:
    """The training run's TrainConfig, ``report``'s ReportCommand, or for ``references ...``
    the arguments that follow (the references command parses them:
    ``training.references.cli``)."""
    parser = build_parser()
    namespace, unparsed = parser.parse_known_args(argv)
    args = vars(namespace)
    command = args.pop("command")
    if command in ("references", "report"):  # the training run's options do not apply
        given = [
            "--" + name.replace("_", "-")
            for name, value in args.items()
            if name not in ("arguments", "model_dir") and value != parser.get_default(name)
        ]
        if given:
            parser.error(
                f"{' '.join(given)} before '{command}' are the training run's options, not "
                f"'{command}''s; give '{command}' first, then its own options"
            )
    if command == "references":  # its options (--help too) are its own
        return [*args["arguments"], *unparsed]
    if command == "report":
        if unparsed:
            parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
        return ReportCommand(args["model_dir"])
    if unparsed:
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
    args.pop("arguments", None)
    return TrainConfig(**args)


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    config = parse_command(argv)
    if not isinstance(config, TrainConfig):
        raise SystemExit("parse_config: expected training options, got the references command")
    return config
