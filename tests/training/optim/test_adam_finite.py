"""Adam's epoch refuses a map or score that is not finite, as L-BFGS's ``ProblemLoss``
does: a NaN map would otherwise reach the held-out judge, whose first NaN score leaves the
keep rule's best at NaN for the rest of the fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.optim.adam import AdamEpochs


class NaNAfterFirstBatch:
    """A problem of 4 rows whose loss is finite on the first batch and NaN after it."""

    n_samples = 4
    objective = "nca"

    def __init__(self):
        self.X = torch.zeros((4, 2))
        self.calls = 0

    def to_tensor(self, theta, requires_grad=False):
        return torch.tensor(theta, dtype=torch.float64, requires_grad=requires_grad)

    def loss(self, params, rows):
        self.calls += 1
        scale = float("nan") if self.calls >= 2 else 1.0
        return scale * (params**2).sum(), 0.5


def test_an_epoch_that_reaches_a_non_finite_map_raises():
    adam = AdamEpochs(NaNAfterFirstBatch(), 0.1, 2, np.random.default_rng(0), tol=0.0)
    theta = np.ones(3)
    with pytest.raises(FloatingPointError, match="not finite; nothing was fitted"):
        adam.step(theta, adam.start(theta))


def test_a_finite_epoch_steps():
    problem = NaNAfterFirstBatch()
    problem.calls = -(10**9)  # finite for every batch
    adam = AdamEpochs(problem, 0.1, 2, np.random.default_rng(0), tol=0.0)
    theta = np.ones(3)
    step = adam.step(theta, adam.start(theta))
    assert np.isfinite(step.x).all() and np.all(step.x < 1.0)  # moved towards 0
