"""The training CLI end to end, and its refusal of bad options and data."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from service.core.artifact import read_artifact
from training import job
from training.cli import main
from training.config import TrainConfig, build_parser
from training.job import resolve_out


def test_end_to_end_on_digits(tmp_path, capsys):
    out = tmp_path / "digits"
    code = main(
        [
            "--data",
            "digits",
            "--n-components",
            "8",
            "--out",
            str(out),
            "--max-iter",
            "30",
            "--quiet",
        ]
    )
    assert code == 0
    art = read_artifact(out)
    assert (art.n_features_in, art.n_components) == (64, 8)
    assert art.classes == list(range(10))
    manifest = art.manifest
    assert manifest["training"]["objective"] == "nca"
    assert manifest["training"]["config"]["n_components"] == 8
    assert manifest["data"]["n_train"] == len(art.embeddings)
    metrics = manifest["metrics"]
    assert metrics["default_k"] == art.default_k
    assert metrics["test_accuracy"][str(art.default_k)] > 0.9
    assert set(metrics["baselines"]) == {"euclidean", "whitening", "pca", "lda", "rca"}
    assert metrics["baselines"]["pca"]["n_components"] == 8
    assert metrics["baselines"]["lda"]["n_components"] == 8
    assert metrics["baselines"]["euclidean"]["n_components"] == 64
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["history"]
    (stage,) = report["training"]["stages"]  # digits' 1,259 rows: one exact stage
    assert stage["stage"] == "exact fit" and stage["iterations"] == report["training"]["n_iter"]
    assert 0 < stage["seconds"] <= report["training"]["fit_seconds"]
    assert report["training"]["max_seconds"] is None and not report["training"]["budget_exhausted"]
    preds = report["test_predictions"]
    acc = np.mean(np.array(preds["class_index"]) == np.array(preds["true_class_index"]))
    assert acc == pytest.approx(metrics["test_accuracy"][str(art.default_k)])
    for png in ("objective.png", "embedding_test.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().err


def test_a_fit_that_did_not_converge_is_said_once(tmp_path, capsys):
    """One line on the console for one warning, when the fit returns (a run that fails
    later has said it): not the estimator's line then, a shorter one after the artifact is
    written and the estimator's again."""
    out = tmp_path / "digits"
    args = ["--data", "digits", "--n-components", "4", "--max-iter", "1", "--no-plots"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    console = capsys.readouterr()
    lines = [x for x in (console.out + console.err).splitlines() if "converge" in x]
    assert len(lines) == 1, lines
    assert lines[0].startswith("WARNING: [NCA] NCA did not converge in max_iter=1")
    training = read_artifact(out).manifest["training"]
    assert not training["converged"] and training["warnings"] == [lines[0].split(": ", 1)[1]]
    # a budget spent likewise: one line (the estimator's), not two
    out = tmp_path / "budget"
    budget = ["--data", "digits", "--n-components", "4", "--max-seconds", "1e-9", "--no-plots"]
    assert main([*budget, "--out", str(out), "--quiet"]) == 0
    console = capsys.readouterr()
    said = ("ran out", "did not converge")  # the estimator's line, the shorter one
    lines = [x for x in (console.out + console.err).splitlines() if any(s in x for s in said)]
    assert len(lines) == 1 and "budget max_seconds=1e-09 ran out" in lines[0], lines


def test_the_fits_warnings_are_said_before_a_later_failure(tmp_path, capsys, monkeypatch):
    """A run that fails after its fit (here: the evaluation) has said the fit's warning."""

    def fails(*args, **kwargs):
        raise MemoryError("no memory for the evaluation")

    monkeypatch.setattr(job, "evaluate", fails)
    out = tmp_path / "digits"
    args = ["--data", "digits", "--n-components", "4", "--max-iter", "1", "--no-plots"]
    with pytest.raises(MemoryError):
        main([*args, "--out", str(out), "--quiet"])
    assert "NCA did not converge in max_iter=1" in capsys.readouterr().err


def test_the_artifact_keeps_the_projected_validation_split(tmp_path):
    out = tmp_path / "digits"
    args = ["--data", "digits", "--n-components", "8", "--out", str(out), "--max-iter", "10"]
    assert main([*args, "--quiet", "--no-plots"]) == 0
    art = read_artifact(out)
    n_val = art.manifest["data"]["n_val"]
    assert art.validation_embeddings.shape == (n_val, 8)
    assert art.validation_labels.shape == (n_val,)
    # the stored embeddings are the validation rows projected by the artifact's own map
    from training.data.datasets import load_dataset, make_split

    config = art.manifest["training"]["config"]
    split = make_split(
        load_dataset("digits"),
        test_size=config["test_size"],
        val_size=config["val_size"],
        seed=config["seed"],
    )
    from service.core.knn import project

    np.testing.assert_array_equal(
        art.validation_embeddings, project(split.X_val, art.projection, art.offset)
    )
    np.testing.assert_array_equal(art.validation_labels, split.y_val)


def test_every_config_field_is_an_option_with_help():
    parser = build_parser(show_advanced=True)
    options = {a.dest: a for a in parser._actions}
    for name in TrainConfig.__dataclass_fields__:
        assert name in options and options[name].help
    for flag in ("--data", "--n-components", "--out"):
        assert flag in parser._option_string_actions


def test_help_runs_as_a_module(python_m_training):
    """training/__main__.py run as ``python -m`` runs it (runpy), in a fork of a process
    that imported training.cli; test_writers runs the module in a fresh interpreter."""
    code, stdout, stderr = python_m_training("--help")
    assert code == 0, stderr
    assert "--n-components" in stdout and "--objective" in stdout


def test_help_lists_the_advanced_settings_only_when_asked(capsys):
    """--help lists the model's and the job's options; FitOptions' fields (but --prototypes)
    are accepted always and listed by --help-advanced (issue 56: a smaller --help)."""
    import argparse

    from training.config import ADVANCED_OPTIONS, parse_config

    hidden = [a for a in build_parser()._actions if a.help == argparse.SUPPRESS]
    assert {a.dest for a in hidden} == {
        f.name
        for f in TrainConfig.__dataclass_fields__.values()
        if f.metadata.get("estimator") in ADVANCED_OPTIONS
    }
    flags = {flag for a in hidden for flag in a.option_strings if not flag.startswith("--no-")}
    assert {"--exact-finish", "--refresh-tol", "--candidate-mass"} <= flags
    short = " ".join(build_parser().format_help().split())
    full = " ".join(build_parser(show_advanced=True).format_help().split())
    assert "--prototypes" in short and "--max-seconds" in short and "--help-advanced" in short
    assert not {flag for flag in flags if f"{flag} " in short}
    assert all(f"{flag} " in full for flag in flags)
    with pytest.raises(SystemExit) as done:
        parse_config(["--help-advanced"])
    assert done.value.code == 0
    assert "--exact-finish" in capsys.readouterr().out
    config = parse_config(["--exact-finish", "0", "--no-stop-stalled-stages"])  # still taken
    assert config.exact_finish == "0" or config.exact_finish == 0
    assert config.stop_stalled_stages is False


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    "make, extra, message",
    [
        (
            lambda p, r: write_npz(p, X=r.normal(size=20), y=np.arange(20) % 2),
            [],
            "expected a 2-D array",
        ),
        (
            lambda p, r: write_npz(
                p, X=np.where(np.eye(20, 3) == 1, np.nan, 1.0), y=np.arange(20) % 2
            ),
            [],
            "contains NaN or Inf",
        ),
        (
            lambda p, r: write_npz(p, X=np.full((20, 3), np.inf), y=np.arange(20) % 2),
            [],
            "contains NaN or Inf",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.zeros(20)),
            [],
            "need at least 2 classes",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(5, 3)), y=np.arange(5)),
            [],
            "5 samples for 5 classes",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(19) % 2),
            [],
            "has 20 rows but its labels have 19",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--n-components", "4"],
            "--n-components=4 must be at most the data.s number of features, D = 3",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--objective", "lmnn"],
            "objective='lmnn'",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--n-candidates", "many"],
            "--n-candidates='many'",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--l2", "lots"],
            "--l2='lots' must be 'auto' or a number in \\[0, 1e6\\]",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--l2", "-0.5"],
            "--l2='-0.5' must be 'auto' or a number in \\[0, 1e6\\]",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--l2", "1e300"],  # before, refused only inside the fit, as a non-finite loss
            "--l2='1e300' must be 'auto' or a number in \\[0, 1e6\\]",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--solver", "adam", "--learning-rate", "1e30"],
            "--learning-rate=1e\\+30 must be a finite real number in \\(0, 1000\\]",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--exact-finish", "lots"],
            "--exact-finish='lots' must be 'auto' or an integer >= 0",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--exact-finish", "-2"],
            "--exact-finish='-2' must be 'auto' or an integer >= 0",
        ),
        (
            lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
            ["--test-size", "1.5"],
            "--test-size=1.5 must lie in",
        ),
        *[
            (
                lambda p, r: write_npz(p, X=r.normal(size=(20, 3)), y=np.arange(20) % 2),
                [option, text],
                message,
            )
            for option, text, message in [
                ("--max-seconds", "0", "--max-seconds=0.0 must be a number of seconds > 0"),
                ("--max-seconds", "-5", "--max-seconds=-5.0 must be a number of seconds > 0"),
                ("--max-seconds", "inf", "--max-seconds=inf must be a number of seconds > 0"),
                ("--init-scale", "0", r"--init-scale='0' must be 'auto' or a number in \[1e-06"),
                ("--init-scale", "big", "--init-scale='big' must be 'auto' or a number in"),
                ("--init-scale", "1e19", "--init-scale='1e19' must be 'auto' or a number in"),
                ("--init-scale", "1e-30", "--init-scale='1e-30' must be 'auto' or a number in"),
                ("--progress", "fancy", "--progress='fancy' must be one of"),
            ]
        ],
        (lambda p, r: write_npz(p, Z=np.zeros(3)), [], r"missing arrays \['X', 'y'\]"),
        (lambda p, r: str(p.with_suffix(".feather")), [], "expected one of the built-in sets"),
        (lambda p, r: str(p.with_suffix(".parquet")), [], "no such file"),
        (lambda p, r: str(p.with_name("absent.npz")), [], "no such file"),
    ],
)
def test_bad_input_exits_nonzero_names_the_problem_and_writes_nothing(
    tmp_path, capsys, make, extra, message
):
    rng = np.random.default_rng(0)
    data = make(tmp_path / "data.npz", rng)
    out = tmp_path / "out"
    code = main(["--data", data, "--out", str(out), "--quiet", "--max-iter", "5", *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert "error:" in err and __import__("re").search(message, err), err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["data.npz"] if (tmp_path / "data.npz").exists() else []
    )


def test_csv_with_string_labels_and_header(tmp_path):
    rng = np.random.default_rng(0)
    rows = ["f1,f2,species"]
    for i in range(60):
        cls = ["setosa", "virginica", "versicolor"][i % 3]
        rows.append(f"{rng.normal() + i % 3},{rng.normal()},{cls}")
    (tmp_path / "d.csv").write_text("\n".join(rows))
    out = tmp_path / "m"
    code = main(
        [
            "--data",
            str(tmp_path / "d.csv"),
            "--label-column",
            "species",
            "--out",
            str(out),
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0
    art = read_artifact(out)
    assert art.classes == ["setosa", "versicolor", "virginica"]
    assert art.n_features_in == 2 and art.n_components == 2


def test_npy_pair_and_given_test_split(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 4)) + (np.arange(80) % 2)[:, None]
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", np.arange(80) % 2)
    out = tmp_path / "m"
    assert (
        main(
            [
                "--data",
                str(tmp_path / "X.npy"),
                "--labels",
                str(tmp_path / "y.npy"),
                "--out",
                str(out),
                "--quiet",
                "--no-plots",
            ]
        )
        == 0
    )
    assert read_artifact(out).n_features_in == 4
    np.savez(tmp_path / "tt.npz", X=X, y=np.arange(80) % 2, X_test=X[:10], y_test=np.arange(10) % 2)
    assert (
        main(["--data", str(tmp_path / "tt.npz"), "--out", str(out), "--quiet", "--no-plots"]) == 0
    )
    assert read_artifact(out).manifest["data"]["n_test"] == 10


def test_npy_without_labels_is_refused(tmp_path, capsys):
    np.save(tmp_path / "X.npy", np.zeros((4, 2)))
    assert main(["--data", str(tmp_path / "X.npy"), "--quiet"]) == 2
    assert "needs --labels" in capsys.readouterr().err


def test_timestamped_out_and_publish_symlink(tmp_path, monkeypatch):
    import os

    link = tmp_path / "current"
    args = [
        "--data",
        "iris",
        "--out",
        str(tmp_path / "versions" / "{timestamp}"),
        "--publish",
        str(link),
        "--quiet",
        "--no-plots",
    ]
    assert main(args) == 0
    first = os.readlink(link)
    assert first.startswith("versions/") and "{timestamp}" not in first
    art = read_artifact(link)
    assert art.n_features_in == 4
    later = time.time() + 60  # a minute on: a new {timestamp}, without waiting for it
    monkeypatch.setattr(job, "resolve_out", lambda out, name: resolve_out(out, name, now=later))
    assert main([*args, "--seed", "1"]) == 0
    assert os.readlink(link) != first and read_artifact(link).version != art.version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "versions"]


def test_publish_refuses_to_replace_a_real_directory(tmp_path, capsys):
    (tmp_path / "current").mkdir()
    code = main(
        [
            "--data",
            "iris",
            "--out",
            str(tmp_path / "v"),
            "--publish",
            str(tmp_path / "current"),
            "--quiet",
        ]
    )
    assert code == 2 and "is not a symlink" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_decision_rule_auto_serves_the_rule_and_k_best_on_validation(tmp_path):
    """By default the job scores the majority vote and the soft vote at each temperature
    for every k on validation and serves the best pair: the artifact, report.json and the
    test predictions agree on it, and its validation accuracy is the best of all pairs; a
    rule given is served as given. (tests/training/evaluation/test_served_vote.py: a soft
    vote at t < 1 served as the map multiplied by sqrt(t).)"""
    from training.evaluation.evaluate import SERVED_VOTES, parse_vote

    out = tmp_path / "auto"
    args = ["--data", "digits", "--n-components", "8", "--k-folds", "0"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    artifact = read_artifact(out)
    report = json.loads((out / "report.json").read_text())
    metrics = report["metrics"]
    by_rule = metrics["val_accuracy_by_rule"]
    assert set(by_rule) == set(SERVED_VOTES)
    assert artifact.decision_rule == metrics["decision_rule"] == report["test_predictions"]["rule"]
    assert parse_vote(metrics["vote"])[0] == metrics["decision_rule"]
    # the float32 factor the served map carries (a warm start divides it out)
    assert metrics["map_scale"] == float(np.float32(np.sqrt(parse_vote(metrics["vote"])[1])))
    best = max(v for by_k in by_rule.values() for v in by_k.values())
    assert metrics["val_accuracy_at_default_k"] == best
    assert by_rule[metrics["vote"]][str(artifact.default_k)] == best
    given = tmp_path / "soft"
    args = ["--data", "digits", "--n-components", "8", "--decision-rule", "soft"]
    assert main([*args, "--out", str(given), "--quiet"]) == 0
    assert read_artifact(given).decision_rule == "soft"
    assert "val_accuracy_by_rule" not in json.loads((given / "report.json").read_text())["metrics"]


def test_publish_never_repoints_a_link_to_something_that_is_not_an_artifact(tmp_path, capsys):
    """A link the user made to their data (a directory, a file) is not ours to repoint:
    exit 2, one line naming it, nothing written, the link as it was. A dangling link, or a
    link to an artifact, is repointed."""
    data, notes = tmp_path / "data", tmp_path / "notes.txt"
    data.mkdir()
    notes.write_text("mine")
    for target in (data, notes):
        link = tmp_path / f"to-{target.name}"
        link.symlink_to(target)
        out = tmp_path / f"v-{target.name}"
        args = ["--data", "iris", "--out", str(out), "--publish", str(link), "--quiet"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "not a model artifact" in err and str(target) in err and len(err.splitlines()) == 1
        assert os.readlink(link) == str(target) and not out.exists()
    dangling = tmp_path / "current"
    dangling.symlink_to(tmp_path / "gone")
    args = ["--data", "iris", "--out", str(tmp_path / "v1"), "--publish", str(dangling)]
    assert main([*args, "--quiet"]) == 0 and dangling.resolve() == (tmp_path / "v1").resolve()
    args[3] = str(tmp_path / "v2")  # now a link to an artifact: repointed
    assert main([*args, "--quiet"]) == 0 and dangling.resolve() == (tmp_path / "v2").resolve()


@pytest.mark.parametrize("objective", ["knca-majority", "knca-all-log"])
def test_knca_end_to_end_records_objective_and_k(tmp_path, objective):
    out = tmp_path / "m"
    args = [
        "--data",
        "iris",
        "--objective",
        objective,
        "--k",
        "3",
        "--n-candidates",
        "8",
        "--max-iter",
        "15",
    ]
    assert main([*args, "--out", str(out), "--quiet", "--no-plots"]) == 0
    manifest = read_artifact(out).manifest
    assert manifest["training"]["objective"] == objective and manifest["training"]["k"] == 3
    # iris's validation split is small: the served k is the best of the cross-fitted curve
    # of the served vote (training k 3 among equals)
    choice = manifest["metrics"]["k_choice"]
    assert choice["method"] == "cross-fitted" and choice["rows"] == 120  # of 150: 30 test
    curve = choice["accuracy"][manifest["metrics"]["vote"]]  # the vote served: "soft@t" too
    best = max(curve.values())
    assert (
        manifest["default_k"] == 3
        if curve["3"] == best
        else curve[str(manifest["default_k"])] == best
    )


def test_knca_needs_enough_candidates(tmp_path, capsys):
    args = ["--data", "iris", "--objective", "knca-majority", "--k", "5", "--n-candidates", "3"]
    assert main([*args, "--out", str(tmp_path / "m"), "--quiet"]) == 2
    assert "n_candidates=3 must be >= k=5" in capsys.readouterr().err


def test_every_shared_setting_defaults_to_the_estimators_except_the_stated_ones():
    import dataclasses

    from training.config import ESTIMATOR_DEFAULTS, JOB_DEFAULTS, TrainConfig

    shared = {f.name: f for f in dataclasses.fields(TrainConfig) if "estimator" in f.metadata}
    assert {"max_iter", "tol", "early_stopping", "n_components", "k", "solver"} <= set(shared)
    for name, f in shared.items():
        expected = JOB_DEFAULTS.get(name, ESTIMATOR_DEFAULTS[name])
        assert f.default == expected, name
    # the deliberate differences, and only those
    differing = {n for n, f in shared.items() if f.default != ESTIMATOR_DEFAULTS[n]}
    assert differing == {"early_stopping"}  # n_components: None in both, read differently
    assert set(JOB_DEFAULTS) == {"n_components", "early_stopping"}
    assert TrainConfig().max_iter == ESTIMATOR_DEFAULTS["max_iter"]


def test_the_cli_help_shows_the_shared_defaults():
    from training.config import ESTIMATOR_DEFAULTS, build_parser

    text = build_parser().format_help()
    assert f"(default: {ESTIMATOR_DEFAULTS['max_iter']})" in " ".join(text.split())


@pytest.mark.parametrize("rule", ["majority", "soft"])
def test_the_job_validates_with_the_rule_and_ks_it_serves(rule):
    from training.config import TrainConfig
    from training.evaluation.evaluate import K_VALUES
    from training.job import build_estimator

    estimator = build_estimator(TrainConfig(decision_rule=rule), n_features=64)
    assert settings_of(estimator).validation_rule == rule
    assert (
        tuple(settings_of(estimator).validation_k) == K_VALUES
    )  # the served k is chosen among these
    assert settings_of(estimator).early_stopping and estimator.n_components == 32


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ("0", 0.0), ("1e-2", 0.01)])
def test_l2_takes_auto_or_a_number_on_the_command_line(text, expected):
    from training.config import TrainConfig, parse_config
    from training.job import build_estimator

    assert TrainConfig().l2 == "auto"
    estimator = build_estimator(parse_config(["--l2", text]), n_features=64)
    assert estimator.l2 == expected


def test_exact_finish_reaches_the_estimator():
    from training.config import parse_config
    from training.job import build_estimator

    assert settings_of(build_estimator(parse_config([]), n_features=64)).exact_finish == "auto"
    for text, expected in (("auto", "auto"), ("0", 0), ("25", 25)):
        config = parse_config(["--exact-finish", text])
        assert settings_of(build_estimator(config, n_features=64)).exact_finish == expected


def test_optional_numbers_take_none_on_the_command_line():
    from training.config import parse_config

    config = parse_config(
        ["--refresh-tol", "none", "--candidate-mass", "0.8", "--chunk-size", "None"]
    )
    assert (config.refresh_tol, config.candidate_mass, config.chunk_size) == (None, 0.8, None)
    assert parse_config(["--refresh-tol", "0.1"]).refresh_tol == 0.1
    with pytest.raises(SystemExit):
        parse_config(["--candidate-mass", "most"])


def test_the_help_names_every_objective_and_the_references_command(capsys):
    from training.objectives.registry import OBJECTIVES

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    objective_help = text[text.index("--objective OBJECTIVE") : text.index("--k K ")]
    for name in OBJECTIVES:
        stem = name.removesuffix("-log")
        assert stem in objective_help, name
    assert "-log forms" in objective_help
    assert "references add, remove or condense the references" in text


def test_references_is_a_declared_command_whose_options_are_its_own(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["references", "--help"])
    assert exit_info.value.code == 0
    assert "{add,remove,condense}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--bogus-option"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "option, text, expected",
    [
        ("--n-candidates", "auto", "auto"),
        ("--n-candidates", "exact", None),
        ("--n-candidates", "12", 12),
        ("--l2", "0.5", 0.5),
        ("--exact-finish", "0", 0),
    ],
)
def test_the_command_lines_text_reaches_the_estimator_parsed(option, text, expected):
    from training.config import parse_config
    from training.job import build_estimator

    estimator = build_estimator(parse_config([option, text]), n_features=64)
    assert getattr(settings_of(estimator), option[2:].replace("-", "_")) == expected


@pytest.mark.parametrize(
    "option, text",
    [("--n-candidates", "0"), ("--n-candidates", "many"), ("--l2", "-1"), ("--exact-finish", "x")],
)
def test_option_text_the_estimator_cannot_take_is_a_config_error(option, text):
    from training.config import parse_config
    from training.errors import ConfigError
    from training.job import build_estimator

    with pytest.raises(ConfigError, match=f"{option}={text!r} must be"):
        build_estimator(parse_config([option, text]), n_features=64)


def test_a_spent_budget_is_said_in_the_output_the_report_and_its_page(tmp_path, capsys):
    out = tmp_path / "digits"
    code = main(
        ["--data", "digits", "--n-components", "8", "--out", str(out), "--max-seconds", "1e-9"]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "budget max_seconds=1e-09 ran out" in err
    training = json.loads((out / "report.json").read_text())["training"]
    assert training["max_seconds"] == 1e-9 and training["budget_exhausted"]
    assert training["stop_reason"] == "max_seconds"
    assert [s["stop_reason"] for s in training["stages"]] == ["skipped (max_seconds)"]
    assert any("ran out" in w for w in training["warnings"])
    page = (out / "report.html").read_text()
    assert "<h2>Stages: what each one cost and bought</h2>" in page
    assert "skipped (max_seconds)" in page and "The budget of 1e-09 s ran out" in page


@pytest.mark.parametrize(
    "option, text, expected",
    [
        ("--max-seconds", "90", ("max_seconds", 90.0)),
        ("--max-seconds", "none", ("max_seconds", None)),
        ("--init-scale", "1", ("init_scale", 1.0)),
        ("--init-scale", "auto", ("init_scale", "auto")),
        ("--no-stop-stalled-stages", None, ("stop_stalled_stages", False)),
    ],
)
def test_the_budget_and_stage_options_reach_the_estimator(option, text, expected):
    from training.config import parse_config
    from training.job import build_estimator

    argv = [option] if text is None else [option, text]
    estimator = build_estimator(parse_config(argv), n_features=64)
    assert getattr(settings_of(estimator), expected[0]) == expected[1]


def test_the_progress_option_chooses_the_bar_or_the_table():
    from training.config import parse_config
    from training.job import build_estimator
    from training.progress import StageBar

    bar = build_estimator(parse_config(["--progress", "bar"]), n_features=64)
    assert isinstance(settings_of(bar).progress, StageBar) and bar.verbose == 0
    table = build_estimator(parse_config(["--progress", "table"]), n_features=64)
    assert settings_of(table).progress is None and table.verbose == 1
    quiet = build_estimator(parse_config(["--progress", "bar", "--quiet"]), n_features=64)
    assert settings_of(quiet).progress is None and quiet.verbose == 0


def test_a_fit_driven_out_of_floating_point_range_is_one_line_and_exit_2(
    tmp_path, capsys, monkeypatch
):
    import training.job

    def overflowing(estimator, split, checkpoint=None):
        raise FloatingPointError("the loss (inf) at iteration 1 is not finite")

    monkeypatch.setattr(training.job, "fit_estimator", overflowing)
    out = tmp_path / "out"
    assert main(["--data", "digits", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "error: the loss (inf) at iteration 1 is not finite"
    assert "Traceback" not in err and not out.exists()


def settings_of(estimator):
    """Every setting the estimator was given, by name (its parameters and its options')."""
    from training.model.options import fit_settings

    return fit_settings(estimator.get_params())


SPIN_AT_TORCH_IMPORT = """
import importlib.abc, os, runpy, sys

seen = []


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:  # the first import of torch loads libgomp
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
        return None


sys.meta_path.insert(0, Watch())
sys.argv = ["training", "--data", "digits", "--dry-run-that-does-not-exist"]
try:
    runpy.run_module("training", run_name="__main__")
except SystemExit:
    pass
print(seen)
"""


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, "10000"),
        ({"GOMP_SPINCOUNT": "7"}, "7"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, None),  # libgomp's own count for the policy: 0
        ({"OMP_WAIT_POLICY": "active"}, None),
    ],
)
def test_the_job_shortens_openmps_spin_before_torch_is_imported_unless_told(given, expected):
    """``python -m training`` sets GOMP_SPINCOUNT (libgomp reads it once, when torch loads
    it) before torch is first imported, and keeps the spin the environment asks for, by a
    count or by a wait policy."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(given)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", SPIN_AT_TORCH_IMPORT],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip().splitlines()[-1] == repr([expected]), done.stderr
