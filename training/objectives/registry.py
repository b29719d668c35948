"""The objectives by name: what ``NCA(objective=...)`` and ``--objective`` accept."""

from __future__ import annotations

from collections.abc import Callable

import torch

from training.objectives import knca_native, native, native_candidates, native_rows, nca_flex
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


def kernels_used(name: str, *, exact: bool, candidates: bool, device: str) -> dict[str, str]:
    """Which implementation evaluates each objective a fit with ``name`` runs: "c" (the
    native kernels of :mod:`training.objectives.native`, built and loaded on this machine;
    for exact NCA its row pass, beside torch's products), "torch", or on CUDA "flex" for
    exact NCA where flex_attention can run. ``exact``: an exact stage or finish;
    ``candidates``: a stage on candidate sets. (A CPU evaluation whose embeddings are not
    finite takes torch instead.)"""
    cpu = not str(device).startswith("cuda")
    used: dict[str, str] = {}
    if name.startswith("nca"):
        if exact:
            loaded = cpu and native.enabled() and native_rows._load() is not None
            used["nca_exact"] = "c" if loaded else "torch"
            if not cpu:
                flex = torch.zeros(1, 1, device=device, dtype=torch.float32)
                used["nca_exact"] = "flex" if nca_flex.usable(flex) else "torch"
        if candidates:
            loaded = cpu and native.enabled() and native_candidates._load(torch.float32)
            used["nca_candidates"] = "c" if loaded else "torch"
    else:
        loaded = cpu and native.enabled() and knca_native._load() is not None
        used["knca"] = "c" if loaded else "torch"
    return used


def make_objective(name: str, k: int = 1, n_classes: int | None = None) -> Objective:
    """Build an objective by name (see ``OBJECTIVES``); kNCA needs k and the number of classes."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got {name!r}")
    if name.startswith("nca") and k != 1:
        raise ValueError(f"objective={name!r} trains a 1-NN rule; k must be 1, got k={k}")
    return OBJECTIVES[name](k, n_classes)
