"""Full-batch L-BFGS on the loss, one step at a time.

The optimiser is written here rather than borrowed from scipy, so that the fit's loop
(``training.model.fitting``) owns its iterations: it takes one step at a time and stops
between any two of them for its own reasons (held-out checks, the budget, stale candidate
sets: ``reset`` forgets the curvature pairs) without raising through a library's callback,
and the optimiser's whole state is a few arrays.

One step (Nocedal & Wright, *Numerical Optimization*, 2nd ed., Alg. 7.4 and 7.5): the
direction d = -H g, where H applies the inverse-Hessian estimate of the last ``memory``
pairs (s_i = x_{i+1} - x_i, y_i = g_{i+1} - g_i) by the two-loop recursion, scaled by
gamma = s'y / y'y of the newest pair; then a line search for a step length a that meets the
strong Wolfe conditions (Alg. 3.5, with the zoom of Alg. 3.6 and cubic interpolation, eq. 3.59)

    f(x + a d) <= f(x) + c1 a g'd        (sufficient decrease)
    |g(x + a d)'d| <= c2 |g'd|            (curvature)

with scipy's L-BFGS-B constants c1 = 1e-3, c2 = 0.9. The first step of a round (no pairs
yet) tries length 1 along -g first, as scipy's, unless the caller gives its first trial
(the finish: ``training.model.fitting.first_step_length``). A step ends the optimisation
when it converged,

    (f_old - f_new) / max(|f_old|, |f_new|, 1) <= tol    or    max |g| <= tol,

or when the line search finds no step that decreases f enough at this precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # ProblemLoss reads a Problem; the optimiser itself knows none
    from training.optim.problem import Problem

SUFFICIENT_DECREASE = 1e-3  # c1
CURVATURE = 0.9  # c2
LINE_SEARCH_EVALUATIONS = 20  # evaluations one line search may spend, at most
MEMORY = 10  # curvature pairs kept (scipy's default)


@dataclass(frozen=True)
class Evaluation:
    """The loss f, its gradient g (n,) and the objective's mean score at one point (what the
    history, the verbose table and ``objective_value_`` report; NaN where not measured)."""

    f: float
    g: np.ndarray
    objective: float = math.nan


@dataclass(frozen=True)
class Step:
    """What one L-BFGS step did: its new point and evaluation, the evaluations it spent, and
    why the optimisation ends there (None: it goes on)."""

    x: np.ndarray
    at: Evaluation
    evaluations: int
    stop: str | None  # "converged", "precision", "max_evaluations" or None
    moved: bool  # False when the start met the gradient test or the line search failed


class LBFGS:
    """The state of one L-BFGS run on ``fun`` (x (n,) -> :class:`Evaluation`; a
    :class:`ProblemLoss` for a :class:`~training.optim.problem.Problem`): its curvature pairs
    and the evaluations spent. ``reset`` forgets the pairs (a new objective: fresh candidate
    sets)."""

    def __init__(self, fun, tol: float, memory: int = MEMORY):
        self.tol, self.memory = tol, memory
        self.evaluations = 0

        def counted(x: np.ndarray) -> Evaluation:
            self.evaluations += 1
            return fun(x)

        self.fun = counted
        self.pairs: list[tuple[np.ndarray, np.ndarray, float]] = []  # (s, y, 1 / y's)

    def reset(self) -> None:
        self.pairs = []

    def pairs_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The curvature pairs as (s (m, P), y (m, P)), oldest first (a checkpoint's)."""
        n = 0 if not self.pairs else self.pairs[0][0].size
        s = np.array([pair[0] for pair in self.pairs]).reshape(len(self.pairs), n)
        y = np.array([pair[1] for pair in self.pairs]).reshape(len(self.pairs), n)
        return s, y

    def restore(self, s: np.ndarray, y: np.ndarray, evaluations: int) -> None:
        """The state ``pairs_arrays`` saved, and the evaluations spent: the next step is
        the one the saved run took."""
        self.pairs = [(si, yi, 1.0 / float(si @ yi)) for si, yi in zip(s, y, strict=True)]
        self.evaluations = evaluations

    def start(self, x: np.ndarray) -> Evaluation:
        """The evaluation a round starts from."""
        return self.fun(x)

    def step(
        self,
        x: np.ndarray,
        at: Evaluation,
        max_evaluations: int | None = None,
        first_length: Callable[[], float] | None = None,
    ) -> Step:
        """One iteration from x (evaluated: ``at``), spending at most ``max_evaluations``
        evaluations (None: LINE_SEARCH_EVALUATIONS). ``first_length``: () -> where the line
        search of a round's first step (along -g) tries first, instead of a unit step;
        called only for such a step, once x has not met the gradient test."""
        if np.max(np.abs(at.g), initial=0.0) <= self.tol:
            return Step(x, at, 0, "converged", moved=False)
        d = self._direction(at.g)
        slope = float(at.g @ d)
        if not slope < 0:  # the estimate lost positive-definiteness: steepest descent
            self.reset()
            d, slope = -at.g, -float(at.g @ at.g)
        first = 1.0 if self.pairs else 1.0 / math.sqrt(-slope)  # length 1 along -g
        if first_length is not None and not self.pairs:
            first = first_length()
        budget = min(LINE_SEARCH_EVALUATIONS, max_evaluations or LINE_SEARCH_EVALUATIONS)
        a, found, spent = line_search(self.fun, x, at, d, slope, first, budget)
        if a == 0.0:  # no step decreased f enough
            out_of_evaluations = max_evaluations is not None and spent >= max_evaluations
            reason = "max_evaluations" if out_of_evaluations else "precision"
            return Step(x, at, spent, reason, moved=False)
        x_new = x + a * d
        s, y = x_new - x, found.g - at.g
        sy = float(s @ y)
        if sy > 1e-10 * float(y @ y):  # keep H positive definite: skip pairs without curvature
            self.pairs = [*self.pairs, (s, y, 1.0 / sy)][-self.memory :]
        reduction = (at.f - found.f) / max(abs(at.f), abs(found.f), 1.0)
        stop = None
        if reduction <= self.tol or np.max(np.abs(found.g), initial=0.0) <= self.tol:
            stop = "converged"
        elif max_evaluations is not None and spent >= max_evaluations:
            stop = "max_evaluations"
        return Step(x_new, found, spent, stop, moved=True)

    def _direction(self, g: np.ndarray) -> np.ndarray:
        """-H g by the two-loop recursion over the kept pairs (-g when there are none)."""
        q = g.copy()
        alphas = []
        for s, y, rho in reversed(self.pairs):
            alpha = rho * float(s @ q)
            q -= alpha * y
            alphas.append(alpha)
        if self.pairs:
            s, y, rho = self.pairs[-1]
            q *= 1.0 / (rho * float(y @ y))  # gamma = s'y / y'y
        for (s, y, rho), alpha in zip(self.pairs, reversed(alphas), strict=True):
            beta = rho * float(y @ q)
            q += (alpha - beta) * s
        return -q


def line_search(fun, x, at: Evaluation, d, slope: float, first: float, budget: int):
    """(a, evaluation at x + a d, evaluations spent): a step length along d meeting the strong
    Wolfe conditions (Alg. 3.5); when the budget runs out first, the best step found that
    meets sufficient decrease, else a = 0. ``slope`` = g'd < 0 at x."""
    a_prev, prev, prev_slope = 0.0, at, slope
    a, spent = first, 0
    while spent < budget:
        here = fun(x + a * d)
        spent += 1
        here_slope = float(here.g @ d)
        if _too_far(here, here_slope, at, a, slope) or (spent > 1 and here.f >= prev.f):
            low, high = (a_prev, prev, prev_slope), (a, here, here_slope)
            return _zoom(fun, x, at, d, slope, low, high, budget, spent)
        if abs(here_slope) <= -CURVATURE * slope:
            return a, here, spent
        if here_slope >= 0:  # past a minimum: it lies between a and the previous step
            low, high = (a, here, here_slope), (a_prev, prev, prev_slope)
            return _zoom(fun, x, at, d, slope, low, high, budget, spent)
        # still descending: extrapolate, as MINPACK's search does (Moré & Thuente 1994):
        # at most to a + 4 (a - a_prev); that far when the slope did not flatten (the line
        # is concave here) or the cubic puts no minimum beyond a, else to the cubic's minimum
        farthest = a + 4.0 * (a - a_prev)
        t = _cubic_minimiser(a_prev, prev.f, prev_slope, a, here.f, here_slope)
        steepened = abs(here_slope) >= abs(prev_slope)
        if steepened or t is None or t <= a:
            a_next = farthest
        else:
            a_next = min(max(t, a + 0.01 * (a - a_prev)), farthest)
        a_prev, prev, prev_slope, a = a, here, here_slope, a_next
    return (a_prev, prev, spent) if a_prev > 0 else (0.0, at, spent)


def _zoom(fun, x, at: Evaluation, d, slope: float, low, high, budget: int, spent: int):
    """Alg. 3.6: shrink [low, high] (each (a, evaluation, slope); low meets sufficient
    decrease and has the lower f) until a step meets the strong Wolfe conditions."""
    while spent < budget:
        (a_lo, lo, lo_slope), (a_hi, hi, hi_slope) = low, high
        width = abs(a_hi - a_lo)
        if width * float(np.max(np.abs(d), initial=0.0)) < 1e-12:
            break  # the interval is below the precision of x
        inner_lo, inner_hi = min(a_lo, a_hi) + 0.1 * width, max(a_lo, a_hi) - 0.1 * width
        a = cubic_minimum(a_lo, lo.f, lo_slope, a_hi, hi.f, hi_slope, inner_lo, inner_hi)
        here = fun(x + a * d)
        spent += 1
        here_slope = float(here.g @ d)
        if _too_far(here, here_slope, at, a, slope) or not here.f < lo.f:
            high = (a, here, here_slope)
            continue
        if abs(here_slope) <= -CURVATURE * slope:
            return a, here, spent
        if here_slope * (a_hi - a_lo) >= 0:
            high = low
        low = (a, here, here_slope)
    a_lo, lo, _ = low
    return (a_lo, lo, spent) if a_lo > 0 else (0.0, at, spent)


def _too_far(here: Evaluation, here_slope: float, at: Evaluation, a: float, slope: float) -> bool:
    """Whether the step a fails sufficient decrease, or lands where the loss or its slope is
    not finite (an overflow: a shorter step is tried)."""
    decreased = here.f <= at.f + SUFFICIENT_DECREASE * a * slope  # False for NaN
    return not decreased or not math.isfinite(here_slope)


def cubic_minimum(a, fa, ga, b, fb, gb, low, high) -> float:
    """The minimiser of the cubic through (a, fa) and (b, fb) with slopes ga and gb
    (Nocedal & Wright eq. 3.59), clipped to [low, high]; their midpoint when the cubic has
    no minimum."""
    t = _cubic_minimiser(a, fa, ga, b, fb, gb)
    return 0.5 * (low + high) if t is None else min(max(t, low), high)


def _cubic_minimiser(a, fa, ga, b, fb, gb) -> float | None:
    """Eq. 3.59's minimiser, or None when the cubic has none (or the arithmetic fails)."""
    if a == b:
        return None
    d1 = ga + gb - 3.0 * (fa - fb) / (a - b)
    discriminant = d1 * d1 - ga * gb
    if not discriminant >= 0:  # NaN too
        return None
    d2 = math.copysign(math.sqrt(discriminant), b - a)
    denominator = gb - ga + 2.0 * d2
    if denominator == 0 or not math.isfinite(denominator):
        return None
    t = b - (b - a) * (gb + d2 - d1) / denominator
    return t if math.isfinite(t) else None


class ProblemLoss:
    """theta -> :class:`Evaluation` of the problem's loss (its mean score as ``objective``),
    refusing a loss or gradient that is not finite (L-BFGS would carry a NaN into the map
    and return it)."""

    def __init__(self, problem: Problem):
        self.problem, self.count = problem, 0

    def __call__(self, theta: np.ndarray) -> Evaluation:
        loss, grad, score = self.problem.loss_and_grad(theta)
        self.count += 1
        if not (math.isfinite(loss) and np.isfinite(grad).all()):
            raise FloatingPointError(
                f"the loss ({loss}) or its gradient ({int((~np.isfinite(grad)).sum())} of "
                f"{grad.size} entries not finite) at evaluation {self.count} of "
                f"{self.problem.objective!r} is not finite; nothing was fitted"
            )
        return Evaluation(loss, grad, score)
