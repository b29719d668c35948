"""The CLI's view of a long fit: one tqdm bar per stage.

The estimator reports each stage's start and every iteration as a
``training.model.fitting.StageProgress`` (``NCA(options={"progress": ...})``);
:class:`StageBar` shows it as a bar per stage: the stage's name, its iterations against its
most, the latest held-out score, tqdm's estimate of the stage's time left (its remaining
iterations at its rate so far) and, with a budget, the fit's budget left beside it. A stage
that stops early (stalled, or converged) leaves its bar where it stopped.

``progress_mode`` decides what a run shows: the bar when both stdout and stderr are a
terminal, the per-iteration table (scikit-learn's verbose lines, on stdout) when either is a
file or a pipe (``python -m training ... > train.log`` keeps the table in the log), and
nothing with ``--quiet``.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from training.errors import ConfigError
from training.model.fitting import StageProgress

PROGRESS_MODES = ("auto", "bar", "table", "none")


def progress_mode(requested: str, quiet: bool, streams: tuple | None = None) -> str:
    """'bar', 'table' or 'none' for the run: ``--quiet`` is 'none'; 'auto' is the bar when
    every one of ``streams`` (stdout, where the table goes, and stderr, where the bar goes)
    is a terminal, else the table. ConfigError for an unknown mode."""
    if requested not in PROGRESS_MODES:
        raise ConfigError(f"--progress={requested!r} must be one of {list(PROGRESS_MODES)}")
    if quiet:
        return "none"
    if requested != "auto":
        return requested
    streams = (sys.stdout, sys.stderr) if streams is None else streams
    return "bar" if all(_is_terminal(stream) for stream in streams) else "table"


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


class StageBar:
    """A callable for ``NCA(options={"progress": ...})`` drawing one bar per stage on
    ``stream`` (None: the stderr of the moment a bar is drawn, so an estimator holding it
    can still be cloned and pickled between fits); call ``close()`` after the fit."""

    def __init__(self, stream: TextIO | None = None, mininterval: float = 0.5):
        self.stream = stream
        self.mininterval = mininterval
        self.bar: tqdm | None = None
        self.stage: str | None = None

    def __call__(self, event: StageProgress) -> None:
        if event.stage != self.stage or self.bar is None:
            self.close()
            self.stage = event.stage
            self.bar = tqdm(
                total=max(event.max_iter, 1),
                desc=event.stage,
                unit="it",
                file=sys.stderr if self.stream is None else self.stream,
                mininterval=self.mininterval,
                dynamic_ncols=True,
            )
        self.bar.update(event.iteration - self.bar.n)
        self.bar.set_postfix_str(self.postfix(event), refresh=False)

    @staticmethod
    def postfix(event: StageProgress) -> str:
        """'held-out 0.9812, budget left 41 s' (the parts that are known)."""
        parts = []
        if event.held_out is not None:
            parts.append(f"held-out {event.held_out:.4f}")
        if event.max_seconds is not None:
            parts.append(f"budget left {max(event.max_seconds - event.seconds, 0.0):.0f} s")
        return ", ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.stage = None, None
