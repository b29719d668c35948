"""The objectives by name: what ``NCA(objective=...)`` and ``--objective`` accept."""

from __future__ import annotations

from collections.abc import Callable

from training.objectives.knca import KNCAObjective
from training.objectives.nca import NCAObjective, Objective

# name -> (k, n_classes) -> objective
OBJECTIVES: dict[str, Callable[[int, int | None], Objective]] = {
    "nca": lambda k, n_classes: NCAObjective(log_form=False),
    "nca-log": lambda k, n_classes: NCAObjective(log_form=True),
    "knca-majority": lambda k, n_classes: KNCAObjective("majority", k, False, n_classes),
    "knca-majority-log": lambda k, n_classes: KNCAObjective("majority", k, True, n_classes),
    "knca-all": lambda k, n_classes: KNCAObjective("all", k, False, n_classes),
    "knca-all-log": lambda k, n_classes: KNCAObjective("all", k, True, n_classes),
}


def make_objective(name: str, k: int = 1, n_classes: int | None = None) -> Objective:
    """Build an objective by name (see ``OBJECTIVES``); kNCA needs k and the number of classes."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got {name!r}")
    if name.startswith("nca") and k != 1:
        raise ValueError(f"objective={name!r} trains a 1-NN rule; k must be 1, got k={k}")
    return OBJECTIVES[name](k, n_classes)
