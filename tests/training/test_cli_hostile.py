"""Hostile inputs and outputs of the training job and the references commands, found by a
hostile pass (round 6): each gets a clear one-line refusal naming the problem (exit 2),
or a right answer; nothing half-written, nothing deleted that the job did not write, no
silent wrong answer.

Each command runs as ``python -m training`` in a process of its own (the ``python_m_training``
fixture of tests/conftest.py: a fork of one process that imported the job once), on small
data, with every path absolute (those processes run in the repository root)."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

FAST = ["--n-components", "2", "--max-iter", "3", "--no-plots", "--quiet"]
INT64_MIN = -(2**63)


def small_data(n_per_class: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(X (3n, 4), y (3n,)): three classes that differ along the first feature."""
    rng = np.random.default_rng(seed)
    y = np.repeat([0, 1, 2], n_per_class)
    X = rng.normal(size=(len(y), 4))
    X[:, 0] += 2 * y
    return X, y


def write_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def classes_of(artifact: Path) -> list:
    return json.loads((artifact / "manifest.json").read_text())["classes"]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


# ------------------------------------------------------------------------- labels


def test_float_labels_beyond_int64_are_not_silently_merged(python_m_training, tmp_path):
    """y = 0.0, 1e30, 2e30: three classes. Cast to int64, 1e30 and 2e30 both became -2**63
    (numpy's undefined cast): the job trained and served two classes, one a label the data
    never had, and exited 0. Float labels beyond 2**53 are now refused."""
    X, y = small_data()
    data = write_npz(tmp_path / "d.npz", X=X, y=np.array([0.0, 1e30, 2e30])[y])
    out = tmp_path / "out"
    code, _, err = python_m_training("--data", data, "--out", out, *FAST)
    assert code == 2 and "Traceback" not in err, err
    (line,) = error_lines(err)
    assert "within +-2**53" in line and "1e+30" in line, line
    assert not out.exists()


def test_references_add_refuses_float_labels_beyond_int64(python_m_training, tmp_path):
    """``references add`` with labels 1e30 added a class -2**63 (a RuntimeWarning from numpy
    the only sign) and exited 0."""
    X, y = small_data()
    model = tmp_path / "m"
    data = write_npz(tmp_path / "d.npz", X=X, y=y)
    assert python_m_training("--data", data, "--out", model, *FAST)[0] == 0
    new = write_npz(tmp_path / "new.npz", X=X[:5], y=np.full(5, 1e30))
    out = tmp_path / "m2"
    code, _, err = python_m_training(
        "references", "add", "--model", model, "--data", new, "--out", out
    )
    assert code == 2 and "Traceback" not in err, err
    assert "within +-2**53" in err, err
    assert not out.exists() and INT64_MIN not in classes_of(model)


# ------------------------------------------------------------------------- readers


def test_a_truncated_npz_member_is_not_called_a_pickle(python_m_training, tmp_path):
    """An .npz whose X member was cut short (a valid zip around a short array) was refused
    as "arrays must load without pickle (EOF: ...)": the file holds no pickle; the line
    says the file is not readable."""
    X, y = small_data()
    member = io.BytesIO()
    np.save(member, X)
    whole = member.getvalue()
    y_member = io.BytesIO()
    np.save(y_member, y)
    data = tmp_path / "cut.npz"
    with zipfile.ZipFile(data, "w") as archive:
        archive.writestr("X.npy", whole[: len(whole) - 512])
        archive.writestr("y.npy", y_member.getvalue())
    out = tmp_path / "out"
    code, _, err = python_m_training("--data", data, "--out", out, *FAST)
    assert code == 2 and "Traceback" not in err, err
    (line,) = error_lines(err)
    assert "pickle" not in line, line
    assert not out.exists()


# ------------------------------------------------------------------------- writers


def test_a_directory_under_an_owned_name_is_not_deleted(python_m_training, tmp_path):
    """An artifact whose report.html is now a directory holding the user's file: the
    ownership check went by name only, so a retrain to the same --out exchanged the
    directories and removed the old one, the user's file with it."""
    X, y = small_data()
    data = write_npz(tmp_path / "d.npz", X=X, y=y)
    out = tmp_path / "m"
    assert python_m_training("--data", data, "--out", out, *FAST)[0] == 0
    (out / "report.html").unlink()
    (out / "report.html").mkdir()
    keep = out / "report.html" / "keep.txt"
    keep.write_text("precious")
    code, _, err = python_m_training("--data", data, "--out", out, *FAST)
    assert "Traceback" not in err, err
    assert keep.exists(), f"exit {code}: the user's file under {out}/report.html/ was deleted"


@pytest.mark.parametrize("inside", ["", "ck"])
def test_a_checkpoint_dir_in_out_is_refused_before_the_fit(python_m_training, tmp_path, inside):
    """``--checkpoint-dir`` equal to --out (or under it) was accepted, the fit ran and saved
    its state there, and then the job refused its own --out ("exists and is not an artifact
    ... it holds fit-rank0.npz"), exit 2 after the work, and every rerun the same way. It
    is refused before the data is read."""
    X, y = small_data()
    data = write_npz(tmp_path / "d.npz", X=X, y=y)
    out = tmp_path / "m"
    checkpoint = out / inside if inside else out
    args = ("--data", data, "--out", out, "--checkpoint-dir", checkpoint, *FAST)
    code, _, err = python_m_training(*args)
    assert "Traceback" not in err, err
    if code == 0:
        assert (out / "manifest.json").is_file()
    else:
        assert code == 2
        assert not out.exists(), f"refused, yet left {sorted(p.name for p in out.iterdir())}"
        assert "learning d=" not in err, "refused only after the fit"


def test_an_unknown_option_with_a_value_is_named(python_m_training, tmp_path):
    """``--validation-fraction 0.2`` (not an option of the job: --val-size is) was refused
    as "argument command: invalid choice: '0.2' (choose from 'references', 'report')",
    naming the value, not the option."""
    X, y = small_data()
    data = write_npz(tmp_path / "d.npz", X=X, y=y)
    out = tmp_path / "out"
    code, _, err = python_m_training(
        "--data", data, "--out", out, "--validation-fraction", "0.2", *FAST
    )
    assert code == 2 and "Traceback" not in err, err
    (line,) = error_lines(err)
    assert "unrecognized option --validation-fraction (given the value '0.2')" in line, line
    assert not out.exists()
    # a command misspelt is still called an invalid choice
    code, _, err = python_m_training("refrences", "add")
    assert code == 2 and "invalid choice: 'refrences'" in err, err


# ------------------------------------------------------------------------- features


def test_features_constant_in_every_row_are_refused_before_the_fit(python_m_training, tmp_path):
    """Every feature the same in every row: every distance is 0. The job trained a map that
    could not tell the classes apart and exited 0 (served accuracy = the largest class's
    share); it is now refused before the fit, naming X and what is expected."""
    _, y = small_data()
    data = write_npz(tmp_path / "d.npz", X=np.full((len(y), 4), 7.5), y=y)
    out = tmp_path / "out"
    code, _, err = python_m_training("--data", data, "--out", out, *FAST)
    assert code == 2 and "Traceback" not in err, err
    (line,) = error_lines(err)
    assert "every one of its 4 features has the same value" in line, line
    assert "expected at least one feature that varies" in line, line
    assert not out.exists()


def test_no_test_rows_are_said_not_scored_as_nan(python_m_training, tmp_path):
    """A data set with an empty X_test: the job printed 'test accuracy nan' and numpy's
    warnings from a picture of no rows. It now says there were no test rows, and writes no
    picture of them."""
    X, y = small_data()
    data = write_npz(tmp_path / "d.npz", X=X, y=y, X_test=X[:0], y_test=y[:0])
    out = tmp_path / "out"
    args = [a for a in FAST if a not in ("--no-plots", "--quiet")]
    code, stdout, err = python_m_training("--data", data, "--out", out, *args)
    assert code == 0, err
    said = stdout + err
    assert "no test rows, so no test accuracy" in said, said
    assert "nan" not in said and "Warning" not in said, said
    assert (out / "objective.png").exists() and not (out / "embedding_test.png").exists()
    assert json.loads((out / "report.json").read_text())["metrics"]["test_accuracy"] == {}
