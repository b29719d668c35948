"""The CLI's view of a long fit: one tqdm bar per stage.

The estimator reports each stage's start and every iteration as a
``training.optim.stages.StageProgress`` (``NCA(progress=...)``); :class:`StageBar` shows it
as a bar per stage: the stage's name, its iterations against its most, the latest held-out
score, and the time left: tqdm's estimate for the stage's remaining iterations at its rate
so far, or the fit's budget left when that is sooner. A stage that stops early (stalled, or
converged) leaves its bar where it stopped.

``progress_mode`` decides what a run shows: the bar on a terminal, the per-iteration table
(scikit-learn's verbose lines, one per iteration) when the output is a file or a pipe, and
nothing with ``--quiet``.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from training.errors import ConfigError
from training.optim.stages import StageProgress

PROGRESS_MODES = ("auto", "bar", "table", "none")


def progress_mode(requested: str, quiet: bool, stream: TextIO | None = None) -> str:
    """'bar', 'table' or 'none' for the run: ``--quiet`` is 'none'; 'auto' is the bar when
    ``stream`` (stderr) is a terminal, else the table. ConfigError for an unknown mode."""
    if requested not in PROGRESS_MODES:
        raise ConfigError(f"--progress={requested!r} must be one of {list(PROGRESS_MODES)}")
    if quiet:
        return "none"
    if requested != "auto":
        return requested
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "table"


class StageBar:
    """A callable for ``NCA(progress=...)`` drawing one bar per stage on ``stream``; call
    ``close()`` after the fit."""

    def __init__(self, stream: TextIO | None = None, mininterval: float = 0.5):
        self.stream = sys.stderr if stream is None else stream
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
                file=self.stream,
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
