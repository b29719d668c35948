"""The estimator's parameters as a table of constraints, in the manner of scikit-learn's
``_parameter_constraints``: each parameter lists what it accepts, and :func:`check` refuses
any other value with one message naming the parameter, the value and what is accepted
(``n_candidates=0 must be 'auto', None or an integer >= 1``). Checks that need the data
(n_components <= D, k < N, ...) are :func:`check_against_data`'s.
Tested by the bad-parameter table of ``tests/training/model/test_estimator.py``.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.vocabulary import NEIGHBOUR_RULES
from training.model.initialization import INIT_NAMES
from training.model.options import validation_ks
from training.model.plan import is_knca
from training.objectives.registry import OBJECTIVES

SOLVERS = ("auto", "lbfgs", "adam")
TRANSFORMS = ("linear", "diagonal")
# standardize= values: booleans keep their meaning from before "global" and "auto" existed
STANDARDIZE_CHOICES = ("auto", "feature", "global", "none", True, False)


@dataclass(frozen=True)
class Integer:
    """An integer (not a bool) >= minimum."""

    minimum: int

    def accepts(self, value: Any) -> bool:
        return (
            isinstance(value, numbers.Integral)
            and not isinstance(value, bool)
            and value >= self.minimum
        )

    def __str__(self) -> str:
        return f"an integer >= {self.minimum}"


@dataclass(frozen=True)
class Real:
    """A finite real number (not a bool) in an interval; ``None`` bounds are open-ended."""

    low: float | None = None
    high: float | None = None
    low_closed: bool = True
    high_closed: bool = True

    def accepts(self, value: Any) -> bool:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            return False
        if not math.isfinite(value):
            return False
        above = self.low is None or value > self.low or (self.low_closed and value == self.low)
        below = self.high is None or value < self.high or (self.high_closed and value == self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"a finite real number {'>=' if self.low_closed else '>'} {self.low:g}"
        left, right = "[" if self.low_closed else "(", "]" if self.high_closed else ")"
        return f"a finite real number in {left}{self.low:g}, {self.high:g}{right}"


@dataclass(frozen=True)
class OneOf:
    """One of the given values (booleans by identity: True is not 1)."""

    values: tuple

    def accepts(self, value: Any) -> bool:
        return any(
            value is option or (not isinstance(option, bool) and _equal(value, option))
            for option in self.values
        )

    def __str__(self) -> str:
        return f"one of {self.values}"


class Callable_:
    """A callable taking the arguments ``signature`` names (what the message says)."""

    def __init__(self, signature: str):
        self.signature = signature

    def accepts(self, value: Any) -> bool:
        return callable(value)

    def __str__(self) -> str:
        return f"a callable({self.signature})"


def _equal(value: Any, option: Any) -> bool:
    try:
        return isinstance(value, type(option)) and bool(value == option)
    except (TypeError, ValueError):  # arrays and other values without a truth value
        return False


AUTO = OneOf(("auto",))
NONE = OneOf((None,))

# the largest l2: the penalty is on a mean score within [-1, 0], so above 1e6 it outweighs
# the loss at any map but the zero map, and near 1e300 it overflows (refused before the fit,
# not inside it)
L2_MAX = 1e6

CONSTRAINTS: dict[str, list] = {
    "objective": [OneOf(tuple(sorted(OBJECTIVES)))],
    "k": [Integer(1)],
    "transformation": [OneOf(TRANSFORMS)],
    "solver": [OneOf(SOLVERS)],
    "max_iter": [Integer(1)],
    "tol": [Real(0)],
    "l2": [AUTO, Real(0, L2_MAX)],
    "n_candidates": [AUTO, NONE, Integer(1)],
    "refresh_every": [Integer(1)],
    "refresh_tol": [NONE, Real(0, 1, low_closed=False, high_closed=False)],
    "candidate_mass": [NONE, Real(0, 1, low_closed=False)],
    "exact_finish": [AUTO, Integer(0)],
    "chunk_size": [NONE, Integer(1)],
    "batch_size": [Integer(1)],
    # Adam moves each entry of A about learning_rate an epoch: standardised inputs' maps have
    # entries of order 1, and 1e30 overflowed the map inside the fit
    "learning_rate": [Real(0, 1e3, low_closed=False)],
    "validation_fraction": [Real(0, 1, low_closed=False, high_closed=False)],
    "n_iter_no_change": [Integer(1)],
    "validation_interval": [Integer(1)],
    "validation_rule": [OneOf(NEIGHBOUR_RULES)],
    "standardize": [OneOf(STANDARDIZE_CHOICES)],
    "callback": [NONE, Callable_("transformation, n_iter")],
    "prototypes": [NONE, Real(1, low_closed=False)],
    "candidate_search": [OneOf(("auto", "exact", "ivf"))],
    "select_stages": [OneOf((True, False))],
    "max_seconds": [NONE, Real(0, low_closed=False)],
    # a factor outside [1e-6, 1e6] makes every p_ij uniform or the distances overflow float32
    "init_scale": [AUTO, Real(1e-6, 1e6)],
    "stop_stalled_stages": [OneOf((True, False))],
    "progress": [NONE, Callable_("StageProgress")],
    "held_out_score": [NONE, Callable_("A, stage, iteration")],
}


def describe(constraints: list) -> str:
    """'a', 'a or b', 'a, b or c'."""
    words = ["None" if c is NONE else "'auto'" if c is AUTO else str(c) for c in constraints]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def violation(params: dict[str, Any]) -> tuple[str, Any, str] | None:
    """(name, value, what it accepts) of the first parameter whose value no constraint of
    its row accepts, or None."""
    for name, constraints in CONSTRAINTS.items():
        value = params[name]
        if not any(c.accepts(value) for c in constraints):
            return name, value, describe(constraints)
    return None


def check(params: dict[str, Any]) -> None:
    """ValueError naming the first parameter whose value no constraint of its row accepts."""
    found = violation(params)
    if found is not None:
        name, value, accepted = found
        raise ValueError(f"{name}={value!r} must be {accepted}")


def check_init_name(init: Any) -> None:
    """ValueError when ``init`` is a name (text or a path) that is neither an initialisation
    nor an existing artifact directory."""
    if isinstance(init, (str, os.PathLike)) and str(init) not in INIT_NAMES:
        if not os.path.isdir(init):
            raise ValueError(
                f"init={str(init)!r} must be one of {INIT_NAMES}, an array of shape "
                "(n_components, n_features) or an existing artifact directory"
            )


def check_against_data(est, n_samples: int, n_features: int) -> int:
    """The checks that need the data: n_components (None resolved) within D, the diagonal
    transform's shape, k < N, kNCA's candidates, validation_k, an init path.
    Returns d."""
    d = est.n_components
    if d is None:  # as scikit-learn: the rows of an array init, else the input dimension
        # (an init with more rows than X has columns is then refused by initial_components)
        rows = est.init.shape[0] if isinstance(est.init, np.ndarray) else n_features
        d = min(rows, n_features)
    if not Integer(1).accepts(d):
        raise ValueError(f"n_components={d!r} must be an integer >= 1")
    if d > n_features:
        raise ValueError(
            f"The preferred dimensionality of the projected space `n_components` ({d}) "
            f"cannot be greater than the given data dimensionality ({n_features})!"
        )
    if est.transformation == "diagonal" and d != n_features:
        raise ValueError(
            f"transformation='diagonal' needs n_components = n_features = {n_features}, got {d}"
        )
    if n_samples < 2:
        raise ValueError(f"NCA needs at least 2 samples, got n_samples={n_samples}")
    if est.k > n_samples - 1:
        raise ValueError(f"k={est.k} must be <= n_samples - 1 = {n_samples - 1}")
    if is_knca(est.objective) and isinstance(est.n_candidates, int) and est.n_candidates < est.k:
        raise ValueError(
            f"n_candidates={est.n_candidates} must be >= k={est.k}: each point needs k "
            "same-class candidates"
        )
    for vk in validation_ks(est, n_samples):
        if not Integer(1).accepts(vk):
            raise ValueError(f"validation_k={vk!r} must be an integer >= 1")
    check_init_name(est.init)
    return int(d)
