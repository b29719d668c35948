"""The CLI's progress display (training.progress): which one a run shows, and the bar's
content for each stage."""

from __future__ import annotations

import io

import pytest

from training.errors import ConfigError
from training.model.fitting import StageProgress
from training.progress import StageBar, progress_mode


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Closed(io.StringIO):
    def isatty(self) -> bool:
        raise ValueError("I/O operation on closed file")


TTY, FILE = Terminal(), io.StringIO()


@pytest.mark.parametrize(
    "requested, quiet, streams, expected",
    [
        ("auto", False, (TTY, TTY), "bar"),
        ("auto", False, (FILE, TTY), "table"),  # stdout to a log: the table goes there
        ("auto", False, (TTY, FILE), "table"),  # stderr to a file or a pipe
        ("auto", True, (TTY, TTY), "none"),
        ("bar", True, (TTY, TTY), "none"),  # --quiet wins
        ("bar", False, (FILE, FILE), "bar"),
        ("table", False, (TTY, TTY), "table"),
        ("none", False, (TTY, TTY), "none"),
        ("auto", False, (object(), TTY), "table"),  # a stream without isatty
        ("auto", False, (Closed(), TTY), "table"),  # a closed one
    ],
)
def test_the_mode_follows_the_option_quiet_and_the_terminals(requested, quiet, streams, expected):
    assert progress_mode(requested, quiet, streams) == expected


def test_an_unknown_mode_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"--progress='fancy' must be one of \['auto', 'bar'"):
        progress_mode("fancy", False, (TTY, TTY))


def event(stage, iteration, held_out=None, seconds=0.0, max_seconds=None, max_iter=10):
    return StageProgress(stage, iteration, max_iter, held_out, seconds, max_seconds)


def test_a_bar_per_stage_with_its_iterations_score_and_budget_left():
    stream = io.StringIO()
    bar = StageBar(stream, mininterval=0)
    bar(event("candidate stage", 0, 0.95, 1.0, 60.0))
    bar(event("candidate stage", 4, 0.97, 21.5, 60.0))
    assert bar.bar.n == 4 and bar.bar.total == 10
    first = bar.bar
    bar(event("exact finish", 0, 0.97, 30.0, 60.0, max_iter=5))
    assert first.disable and first.n == 4  # the first stage's bar closed where it stopped
    assert bar.bar is not first and bar.bar.total == 5
    bar.close()
    text = stream.getvalue().replace("\r", "\n")
    assert "candidate stage" in text and "exact finish" in text
    assert "4/10" in text and "held-out 0.9700, budget left 38 s" in text
    assert "0/5" in text and "budget left 30 s" in text


@pytest.mark.parametrize(
    "progress, expected",
    [
        (event("s", 1), ""),
        (event("s", 1, held_out=0.5), "held-out 0.5000"),
        (event("s", 1, seconds=70.0, max_seconds=60.0), "budget left 0 s"),
    ],
)
def test_the_postfix_says_only_what_is_known(progress, expected):
    assert StageBar.postfix(progress) == expected


def test_an_estimator_holding_a_bar_clones_and_pickles():
    import pickle

    from sklearn.base import clone

    from training import NCA

    model = NCA(options=dict(progress=StageBar()))
    assert isinstance(clone(model).options["progress"], StageBar)
    assert isinstance(pickle.loads(pickle.dumps(model)).options["progress"], StageBar)
