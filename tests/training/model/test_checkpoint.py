"""A killed fit resumes (``training.model.checkpoint``): the state at each stage's end is
written to the checkpoint directory, and a fit of the same data and parameters started with
it again skips the stages done and ends with the same map, bit for bit, as a fit never
interrupted; a checkpoint of another fit is refused; through the CLI, a job killed in its
exact finish resumes when run again and leaves no checkpoint behind."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from service.core.artifact import read_artifact
from tests.training.problems import hard_noisy
from training import NCA
from training.errors import Interrupted
from training.model import fitting, preparation
from training.model import plan as fit_plan
from training.model.options import with_options

PARAMS = dict(
    n_components=2, n_candidates=5, max_iter=12, random_state=0, validation_interval=2, tol=1e-10
)


def data():
    """Overlapping classes with noisy labels: the fits stop on their iteration counts (the
    exact fit after its 12, the finish after its 5), not on float32's precision, whose
    iteration moves with the order of the sums (well-separated blobs stopped after 5-8). On
    this draw (seed 1) the finish gains on held-out rows at its first iteration, so it runs
    on; on seed 0's its gain there is within a row of the tolerance, and the finish stops
    undone ("no gain") on one thread count and not on another."""
    X, y = hard_noisy(900, seed=1)[:2]
    return X[:600], y[:600], X[600:], y[600:]


class Killed(Exception):
    """Stands for the process's death at an iteration."""


def killer(at_iteration: int):
    def callback(components, iteration):
        if iteration >= at_iteration:
            raise Killed(iteration)

    return callback


def fit(checkpoint=None, **extra):
    X, y, X_val, y_val = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NCA(**with_options({**PARAMS, **extra})).fit(
            X, y, X_val, y_val, checkpoint=checkpoint
        )


def timeless(records: list[dict]) -> list[dict]:
    return [record | {"seconds": 0, "check_seconds": 0} for record in records]


@pytest.fixture
def save_every_iteration(monkeypatch):
    """A mid-stage checkpoint after every iteration of an exact stage (30 s apart by
    default: more often than these fits take)."""
    monkeypatch.setattr(fitting, "CHECKPOINT_SECONDS", 0.0)


@pytest.mark.parametrize("killed_at", [1, 2, 3])
def test_a_fit_killed_in_its_finish_resumes_there_and_ends_with_the_same_map(
    tmp_path, save_every_iteration, killed_at
):
    """Killed at the finish's iteration ``killed_at`` (in its callback, before that
    iteration is saved): the checkpoint holds the candidate stage and the finish as it
    stood an iteration before, and the resumed fit goes on from there to the same map, the
    same records and the same history as a fit never interrupted. Killed at its first
    iteration, the resumed finish runs that iteration and its held-out check again (the
    check that may stop it: "no gain")."""
    whole = fit()
    first_iterations = whole.stages_[0]["iterations"]
    assert [r["stage"] for r in whole.stages_] == ["candidate stage", "exact finish"]
    assert whole.stages_[1]["iterations"] > killed_at
    assert whole.stages_[1]["start_scale"] != 1.0  # the resumed finish must restore it
    with pytest.raises(Killed):
        fit(tmp_path / "ckpt", callback=killer(first_iterations + killed_at))
    assert (tmp_path / "ckpt" / "fit-rank0.npz").is_file()
    resumed = fit(tmp_path / "ckpt")
    assert resumed.resumed_stages_ == 1 and whole.resumed_stages_ == 0
    assert resumed.resumed_iterations_ == first_iterations + killed_at - 1
    np.testing.assert_array_equal(resumed.components_, whole.components_)
    assert timeless(resumed.stages_) == timeless(whole.stages_)
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in whole.history_]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in resumed.history_] == strip
    assert resumed.n_iter_ == whole.n_iter_ and resumed.n_candidates_ == whole.n_candidates_
    assert resumed.objective_value_ == whole.objective_value_
    assert resumed.n_evaluations_ == whole.n_evaluations_
    again = fit(tmp_path / "ckpt")  # every stage done: nothing to run
    assert again.resumed_stages_ == 2
    np.testing.assert_array_equal(again.components_, whole.components_)


def test_a_finish_resumed_with_its_budget_spent_ends_there_and_its_checkpoint_reads_back(
    tmp_path, save_every_iteration, monkeypatch
):
    """Killed at the finish's 3rd iteration, then run again where preparing the data alone
    spends the budget (a scripted clock): the resumed finish stops where its checkpoint
    stood ("max_seconds", its 2 iterations counted; it had been recorded as skipped with 0
    while its iterations stayed in the fit's count), and a third run finds every stage
    done in a checkpoint that reads back, with the same map."""
    now = [0.0]
    monkeypatch.setattr(fitting.time, "perf_counter", lambda: now[0])
    first_iterations = fit(max_seconds=1000.0).stages_[0]["iterations"]
    with pytest.raises(Killed):
        fit(tmp_path / "ckpt", max_seconds=1000.0, callback=killer(first_iterations + 3))
    real_prepare = preparation.prepare

    def slow_prepare(*args, **kwargs):  # 2,000 scripted seconds
        now[0] += 2000.0
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(preparation, "prepare", slow_prepare)
    cut = fit(tmp_path / "ckpt", max_seconds=1000.0)
    finish = cut.stages_[1]
    assert (finish["stop_reason"], finish["iterations"]) == ("max_seconds", 2)
    assert cut.n_iter_ == first_iterations + 2 and cut.budget_exhausted_
    again = fit(tmp_path / "ckpt", max_seconds=1000.0)
    assert again.resumed_stages_ == 2
    np.testing.assert_array_equal(again.components_, cut.components_)


def test_a_warm_start_is_not_resumed_from_the_last_fits_checkpoint(tmp_path):
    """A warm start begins at the last fit's map; the checkpoint the last fit left (same
    data, same settings) holds that fit from its own start. Before, the refit resumed it
    (every stage done) and returned the last map untrained; now the start is part of the
    checkpoint's key and the refit refuses it, naming the remedy."""
    X, y, X_val, y_val = data()
    params = with_options({**PARAMS, **EXACT, "warm_start": True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NCA(**params).fit(X, y, X_val, y_val, checkpoint=tmp_path / "ckpt")
        assert model.resumed_stages_ == 0
        with pytest.raises(ValueError, match="is of another fit"):
            model.fit(X, y, X_val, y_val, checkpoint=tmp_path / "ckpt")


def test_an_exact_fit_killed_mid_way_resumes_at_its_last_iteration(tmp_path, save_every_iteration):
    exact = EXACT
    whole = fit(**exact)
    assert [r["stage"] for r in whole.stages_] == ["exact fit"] and whole.n_iter_ > 4
    with pytest.raises(Killed):  # at iteration 4, before it is saved
        fit(tmp_path / "ckpt", **exact, callback=killer(4))
    resumed = fit(tmp_path / "ckpt", **exact)
    assert resumed.resumed_stages_ == 0 and resumed.resumed_iterations_ == 3
    np.testing.assert_array_equal(resumed.components_, whole.components_)
    assert timeless(resumed.stages_) == timeless(whole.stages_)


EXACT = dict(n_candidates=None, tol=0, stop_stalled_stages=False)  # runs its 12 iterations


def test_a_save_keeps_the_one_before_and_a_lost_last_save_resumes_from_it(
    tmp_path, save_every_iteration
):
    """Each save renames the last one to fit-rank0.previous.npz; with the last one gone (a
    kill between the two renames of a save) the fit resumes from the previous, one
    iteration earlier, to the same map."""
    whole = fit(**EXACT)
    with pytest.raises(Killed):
        fit(tmp_path / "ckpt", **EXACT, callback=killer(5))
    assert (tmp_path / "ckpt" / "fit-rank0.previous.npz").is_file()
    (tmp_path / "ckpt" / "fit-rank0.npz").unlink()
    resumed = fit(tmp_path / "ckpt", **EXACT)
    assert resumed.resumed_iterations_ == 3  # the last save was at 4
    np.testing.assert_array_equal(resumed.components_, whole.components_)


@pytest.mark.parametrize(
    "other_rank, resumed_at, warns",
    [
        (lambda mine: mine, 4, False),  # the ranks agree: the last save
        (lambda mine: mine - 1, 3, False),  # another rank one save behind: the previous
        (lambda mine: -1, 0, True),  # another rank has none: the fit starts over
    ],
    ids=["agree", "one-behind", "none"],
)
def test_ranks_resume_from_the_newest_point_they_all_saved(
    tmp_path, save_every_iteration, monkeypatch, other_rank, resumed_at, warns
):
    """Under torchrun the ranks compare where their saves stand (lowest_and_highest, an
    all-reduce): stood in for here by another rank at ``other_rank(mine)``. The fit resumes
    from the newest point both hold, or starts over, with its generators as drawn, and the
    map is always the uninterrupted one."""
    whole = fit(**EXACT)
    with pytest.raises(Killed):
        fit(tmp_path / "ckpt", **EXACT, callback=killer(5))

    other = []  # the other rank's position: fixed at its first answer

    def lowest_and_highest(mine, group):
        other.append(other[0] if other else other_rank(mine))
        return min(mine, other[0]), max(mine, other[0])

    monkeypatch.setattr(fitting, "lowest_and_highest", lowest_and_highest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        X, y, X_val, y_val = data()
        resumed = NCA(**with_options({**PARAMS, **EXACT})).fit(
            X, y, X_val, y_val, checkpoint=tmp_path / "ckpt"
        )
    said = [str(w.message) for w in caught if "no point of the fit in common" in str(w.message)]
    assert bool(said) == warns, said
    assert resumed.resumed_iterations_ == resumed_at
    np.testing.assert_array_equal(resumed.components_, whole.components_)


def test_a_fit_killed_in_its_first_stage_starts_that_stage_over(tmp_path):
    whole = fit()
    with pytest.raises(Killed):
        fit(tmp_path / "ckpt", callback=killer(2))
    assert not (tmp_path / "ckpt" / "fit-rank0.npz").exists()
    resumed = fit(tmp_path / "ckpt")
    assert resumed.resumed_stages_ == 0
    np.testing.assert_array_equal(resumed.components_, whole.components_)


def test_a_checkpoint_of_another_fit_is_refused(tmp_path):
    fit(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is of another fit"):
        fit(tmp_path / "ckpt", l2=0.5)
    X, y, X_val, y_val = data()
    with pytest.raises(ValueError, match="is of another fit"):
        NCA(**with_options(dict(**PARAMS))).fit(
            X[::-1], y[::-1], X_val, y_val, checkpoint=tmp_path / "ckpt"
        )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "fit-rank0.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"not a fit checkpoint \(not an .npz archive\)"):
        fit(tmp_path / "bad")


def test_a_checkpoint_made_under_another_plan_is_refused(tmp_path, monkeypatch):
    """The same data and parameters under another plan (here the finish's points sampled,
    as a change of the plan's constants between two source trees would do) compute another
    fit: its checkpoint is refused, not resumed against another objective."""
    fit(tmp_path / "ckpt")
    monkeypatch.setattr(fit_plan, "FINISH_MAX_POINTS", 300)
    with pytest.raises(ValueError, match="is of another fit"):
        fit(tmp_path / "ckpt")


def test_a_job_killed_in_its_finish_resumes_when_run_again(python_m_training, tmp_path):
    X, y, _, _ = data()
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    args = ["--data", tmp_path / "X.npy", "--labels", tmp_path / "y.npy", "--n-components", "2"]
    args += ["--n-candidates", "5", "--max-iter", "12", "--no-plots", "--quiet"]
    code, _, err = python_m_training(*args, "--out", tmp_path / "whole")
    assert code == 0, err
    # killed (os._exit) when the exact finish starts: the candidate stage is checkpointed
    kill = (  # by the fit's progress callable, at the finish's start
        "import os\nimport training.job as job\nbuilt = job.build_estimator\n"
        "def at(progress):\n"
        "    if progress.stage == 'exact finish':\n        os._exit(9)\n"
        "def build(config, n):\n    est = built(config, n)\n"
        "    return est.set_params(options={**est.options, 'progress': at})\n"
        "job.build_estimator = build\n"
    )
    code, _, err = python_m_training(*args, "--out", tmp_path / "m", prelude=kill)
    assert code == 9, err
    checkpoint = tmp_path / ".m.checkpoint"
    assert (checkpoint / "fit-rank0.npz").is_file() and not (tmp_path / "m").exists()
    code, _, err = python_m_training(*args, "--out", tmp_path / "m")
    assert code == 0, err
    assert f"resumed from {checkpoint}: 1 stage(s) were done" in err
    assert not checkpoint.exists()  # ours, removed once the artifact is written
    np.testing.assert_array_equal(
        read_artifact(tmp_path / "m").projection, read_artifact(tmp_path / "whole").projection
    )


def test_a_checkpoint_the_disk_refuses_costs_the_checkpoint_not_the_fit(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("where the checkpoint directory should be")
    with pytest.warns(RuntimeWarning, match="cannot write the fit's checkpoint"):
        X, y, X_val, y_val = data()
        model = NCA(**with_options(dict(**PARAMS))).fit(
            X, y, X_val, y_val, checkpoint=blocker / "ckpt"
        )
    np.testing.assert_array_equal(model.components_, fit().components_)


def test_a_job_sigtermed_in_its_exact_fit_saves_there_and_resumes_there(
    python_m_training, tmp_path
):
    """A node drain's SIGTERM during the exact fit's 6th iteration, long before a periodic
    save is due: the signal is held to the iteration's end, the state is saved there, and
    the job exits 143 with one line naming the checkpoint; the same command run again goes
    on from the 6th iteration and writes the uninterrupted map. (Before, the signal raised
    at once and nothing was saved: the run again started over.)"""
    X, y = hard_noisy(600)[:2]  # runs its 30 iterations, far past the signal at the 6th
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    args = ["--data", tmp_path / "X.npy", "--labels", tmp_path / "y.npy", "--n-components", "2"]
    args += ["--n-candidates", "exact", "--max-iter", "30", "--tol", "0", "--no-plots"]
    args += ["--quiet"]
    code, _, err = python_m_training(*args, "--out", tmp_path / "whole")
    assert code == 0, err
    drain = (  # by the fit's callback, at the 6th iteration's end
        "import os, signal\nimport training.job as job\nimport training.model.fitting as f\n"
        "f.CHECKPOINT_SECONDS = 1e9  # no periodic save\n"
        "def at(A, iteration):\n"
        "    if iteration == 6:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
        "built = job.build_estimator\n"
        "job.build_estimator = lambda config, n: built(config, n).set_params(callback=at)\n"
    )
    code, _, err = python_m_training(*args, "--out", tmp_path / "m", prelude=drain)
    checkpoint = tmp_path / ".m.checkpoint"
    assert code == 143, err
    assert "Traceback" not in err
    assert f"resume from the checkpoint in {checkpoint}" in err.strip().splitlines()[-1]
    code, _, err = python_m_training(*args, "--out", tmp_path / "m")
    assert code == 0, err
    assert f"resumed from {checkpoint}: 0 stage(s) were done, 6 iteration(s) in all" in err
    np.testing.assert_array_equal(
        read_artifact(tmp_path / "m").projection, read_artifact(tmp_path / "whole").projection
    )


def _tamper(path, change):
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    change(arrays)
    np.savez(path, **arrays)


def _state_edit(edit):
    """A change of the saved state's JSON (``edit(state)`` in place)."""

    def change(arrays):
        meta = json.loads(str(arrays["meta"]))
        edit(meta["state"])
        arrays["meta"] = np.array(json.dumps(meta))

    return change


TAMPERED = {  # a checkpoint changed after its save (its fingerprint still matches)
    # counts that no fit of this plan reaches: before, each resumed and wrote a model
    "more stages done than planned": _state_edit(lambda s: s.update(stages_done=7)),
    "a stage beyond its max_iter": _state_edit(lambda s: s["resume"].update(iteration=10**6)),
    "negative iterations": _state_edit(lambda s: s.update(iterations=-5)),
    "a history short of the iterations": _state_edit(lambda s: s.update(history=[])),
    "a kept map from the future": _state_edit(lambda s: s["kept"].update(iteration=10**6)),
    "pairs of another length": lambda a: a.update(resume_pairs_s=a["resume_pairs_s"][:, :5]),
    "an infinite iterate": lambda a: a.update(resume_theta=np.full_like(a["resume_theta"], np.inf)),
    "a NaN kept map": lambda a: a.update(theta=np.full_like(a["theta"], np.nan)),
    "a kept map as a matrix": lambda a: a.update(theta=a["theta"].reshape(1, -1)),
    "a state of other fields": lambda a: a.update(
        meta=np.array(str(a["meta"]).replace('"records"', '"recorded"'))
    ),
    "no kept map": lambda a: a.pop("theta"),
    "a meta that is not an object": lambda a: a.update(meta=np.array("[]")),
    "a meta that is not JSON": lambda a: a.update(meta=np.array("{format")),
}


def _beyond_max_iter(state):
    """The running stage one iteration past the plan's max_iter (12), its counts agreeing:
    the fit's iterations and its history grown with it."""
    extra = 13 - state["resume"]["iteration"]
    state["resume"]["iteration"] = 13
    state["iterations"] += extra
    state["history"] += [state["history"][-1]] * extra


def test_a_stage_saved_beyond_its_max_iter_is_refused_by_the_plans_limit(
    tmp_path, save_every_iteration
):
    """Counts that agree with each other but not with the plan: the stage's limit, each
    stage's max_iter passed to the checkpoint by the fit, refuses them."""
    with pytest.raises(Killed):
        fit(tmp_path / "ckpt", **EXACT, callback=killer(5))
    _tamper(tmp_path / "ckpt" / "fit-rank0.npz", _state_edit(_beyond_max_iter))
    with pytest.raises(ValueError, match=r"its stage 0 ran 13 iterations, outside \[0, 12\]"):
        fit(tmp_path / "ckpt", **EXACT)


@pytest.mark.parametrize("change", list(TAMPERED), ids=list(TAMPERED))
def test_a_tampered_checkpoint_is_refused_naming_it_and_the_remedy(
    tmp_path, save_every_iteration, change
):
    """Before, a shorter pair array failed inside the optimiser with numpy's matmul error,
    an infinite iterate was blamed on the loss, a NaN map resumed, a state of other fields
    raised TypeError: now each is one ValueError naming the checkpoint and its remedy."""
    with pytest.raises(Killed):
        fit(tmp_path / "ckpt", **EXACT, callback=killer(5))
    _tamper(tmp_path / "ckpt" / "fit-rank0.npz", TAMPERED[change])
    remedy = f"remove the fit-rank\\*.npz files from {tmp_path / 'ckpt'} to start over"
    with pytest.raises(ValueError, match=remedy) as caught:
        fit(tmp_path / "ckpt", **EXACT)
    assert str(tmp_path / "ckpt" / "fit-rank0.npz") in str(caught.value)


def test_a_rank_without_a_signal_stops_with_the_rank_that_has_one(tmp_path, monkeypatch):
    """Under torchrun every rank asks whether any rank holds a signal after each iteration
    of a checkpointed stage (an all-reduce, stood in for here: another rank's signal from
    the 4th iteration): this rank, which has none, saves there and stops with the others."""
    signalled = []

    def lowest_and_highest(value, group):  # another rank: a signal once signalled is set
        return (value, 1) if signalled else (value, value)

    def callback(components, iteration):
        if iteration == 4:
            signalled.append(True)

    monkeypatch.setattr(fitting, "lowest_and_highest", lowest_and_highest)
    X, y, X_val, y_val = data()
    params = with_options({**PARAMS, **EXACT, "callback": callback})
    with pytest.raises(Interrupted):
        NCA(**params).fit(X, y, X_val, y_val, checkpoint=tmp_path / "ckpt")
    signalled.clear()
    params = with_options({**PARAMS, **EXACT})
    resumed = NCA(**params).fit(X, y, X_val, y_val, checkpoint=tmp_path / "ckpt")
    assert resumed.resumed_iterations_ == 4


def test_a_checkpoint_tells_two_score_functions_apart():
    """held_out_score changes what a fit computes: a checkpoint made under one function is
    not resumed under another (their module and qualified names differ)."""
    from training.model.checkpoint import fingerprint

    X, y = hard_noisy(60)[:2]

    def rising(A, stage, iteration):
        return float(iteration)

    def falling(A, stage, iteration):
        return -float(iteration)

    def key(function):
        return fingerprint(X, y, None, None, {"held_out_score": function}, "v")

    assert key(rising) == key(rising) and key(rising) != key(falling)


def test_a_checkpoint_directory_of_the_users_files_is_refused_naming_only_the_fits_files(
    tmp_path,
):
    """A --checkpoint-dir holding the user's own files and a fit-rank0.npz that is not a
    checkpoint (text): refused as not an .npz archive (numpy would call it pickled data),
    with a remedy that names the fit's files, never the directory; nothing is removed."""
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / "fit-rank0.npz").write_text("not a checkpoint")
    (directory / "keep.txt").write_text("the user's")
    X, y = hard_noisy(200)[:2]
    with pytest.raises(ValueError) as caught:
        NCA(n_components=2, max_iter=3, random_state=0).fit(X, y, checkpoint=directory)
    message = str(caught.value)
    assert "not a fit checkpoint (not an .npz archive)" in message and "pickled" not in message
    assert message.endswith(f"remove the fit-rank*.npz files from {directory} to start over")
    assert sorted(p.name for p in directory.iterdir()) == ["fit-rank0.npz", "keep.txt"]


def test_a_checkpoint_the_user_cannot_read_is_named_as_such_and_kept(tmp_path, monkeypatch):
    """A fit's own checkpoint that this user cannot read (another user's file, or mode 000;
    here the open is refused as such a file refuses it, since the tests may run as root)
    was called 'not a fit checkpoint (not an .npz archive)', with the advice to remove it:
    a resumable fit thrown away. Now the refusal names the cause and keeps the file."""
    import builtins
    import errno

    import training.state_file as state_file

    fit(tmp_path / "ckpt", max_iter=3)  # a finished fit leaves its state: resumable
    saved = tmp_path / "ckpt" / "fit-rank0.npz"
    assert saved.is_file()

    def refusing_open(path, *args, **kwargs):
        if Path(path) == saved:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(state_file, "open", refusing_open, raising=False)
    with pytest.raises(ValueError) as caught:
        fit(tmp_path / "ckpt", max_iter=3)
    message = str(caught.value)
    assert f"checkpoint {saved} cannot be read" in message and "(EACCES)" in message
    assert "make it readable to resume from it" in message and "not an .npz" not in message
    assert saved.is_file()
