"""Our L-BFGS (training.optim.lbfgs) against exact answers and scipy's: the minimiser of a
quadratic, Rosenbrock's function from its classical starts within scipy's iteration counts,
the strong Wolfe conditions at every accepted step, the cubic interpolation's formula, the
evaluation budget, and a start that already meets the gradient test."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize, rosen, rosen_der

from training.optim.lbfgs import (
    CURVATURE,
    LBFGS,
    SUFFICIENT_DECREASE,
    Evaluation,
    cubic_minimum,
    line_search,
)


def evaluation_of(fun):
    return lambda x: Evaluation(*fun(x))


def minimise(fun, x, tol=1e-10, max_iter=1000):
    """(x, f, iterations, evaluations, stop) of L-BFGS run until it stops."""
    solver = LBFGS(evaluation_of(fun), tol)
    at = solver.start(x)
    for iteration in range(1, max_iter + 1):
        step = solver.step(x, at)
        x, at = step.x, step.at
        if step.stop is not None:
            return x, at.f, iteration, solver.evaluations, step.stop
    return x, at.f, max_iter, solver.evaluations, None


def quadratic(n=30, seed=1):
    rng = np.random.default_rng(seed)
    M = rng.normal(size=(n, n))
    Q = M @ M.T + np.eye(n)  # positive definite
    b = rng.normal(size=n)
    return (lambda x: (0.5 * x @ Q @ x - b @ x, Q @ x - b)), np.linalg.solve(Q, b)


def test_a_quadratic_is_minimised_to_its_exact_solution():
    fun, solution = quadratic()
    x, _, iterations, _, stop = minimise(fun, np.zeros(30))
    assert stop == "converged"
    np.testing.assert_allclose(x, solution, atol=1e-4)
    reference = minimize(fun, np.zeros(30), jac=True, method="L-BFGS-B", tol=1e-10)
    assert iterations <= reference.nit + 5


@pytest.mark.parametrize("start", [[-1.2, 1.0], [0.0, 0.0], [0.5] * 10])
def test_rosenbrock_is_solved_within_scipys_work(start):
    fun = lambda x: (rosen(x), rosen_der(x))  # noqa: E731
    x0 = np.array(start, dtype=np.float64)
    x, f, iterations, evaluations, stop = minimise(fun, x0)
    reference = minimize(fun, x0, jac=True, method="L-BFGS-B", tol=1e-10)
    assert stop == "converged" and f < 1e-10
    np.testing.assert_allclose(x, np.ones_like(x0), atol=1e-4)
    assert iterations <= 1.2 * reference.nit + 2 and evaluations <= 1.3 * reference.nfev + 2


def test_every_accepted_step_meets_the_strong_wolfe_conditions():
    fun = evaluation_of(lambda x: (rosen(x), rosen_der(x)))
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.normal(size=6)
        at = fun(x)
        d = -at.g
        slope = float(at.g @ d)
        a, found, spent = line_search(fun, x, at, d, slope, 1.0 / math.sqrt(-slope), 20)
        assert a > 0 and spent <= 20
        assert found.f <= at.f + SUFFICIENT_DECREASE * a * slope
        assert abs(float(found.g @ d)) <= CURVATURE * abs(slope)


def test_the_cubic_interpolation_finds_a_cubics_minimum():
    # f(t) = (t - 1)^3 - 3 (t - 1) has its local minimum at t = 2
    f = lambda t: (t - 1) ** 3 - 3 * (t - 1)  # noqa: E731
    g = lambda t: 3 * (t - 1) ** 2 - 3  # noqa: E731
    assert cubic_minimum(1.5, f(1.5), g(1.5), 3.0, f(3.0), g(3.0), 0.0, 10.0) == pytest.approx(2.0)
    assert cubic_minimum(3.0, f(3.0), g(3.0), 1.5, f(1.5), g(1.5), 0.0, 10.0) == pytest.approx(2.0)
    # clipped to its bounds, and the midpoint when there is no minimum
    assert cubic_minimum(1.5, f(1.5), g(1.5), 3.0, f(3.0), g(3.0), 2.5, 2.8) == 2.5
    assert cubic_minimum(0.0, 0.0, 1.0, 1.0, 2.0, 4.0, 0.0, 1.0) == 0.5  # t^3 + t


def test_the_evaluation_budget_bounds_a_step():
    fun, _ = quadratic()
    solver = LBFGS(evaluation_of(fun), tol=0.0)
    x = np.zeros(30)
    at = solver.start(x)
    step = solver.step(x, at, max_evaluations=1)
    assert step.evaluations == 1 and solver.evaluations == 2
    # the one trial (length 1 along -g) overshoots this quadratic: no step, and the budget's
    # end is said (not "precision")
    assert step.stop == "max_evaluations" and not step.moved and step.at is at


def test_a_start_that_meets_the_gradient_test_does_not_move():
    fun, solution = quadratic()
    solver = LBFGS(evaluation_of(fun), tol=1e-6)
    at = solver.start(solution)
    step = solver.step(solution, at)
    assert not step.moved and step.stop == "converged" and step.evaluations == 0


def test_the_same_problem_gives_the_same_iterates_bit_for_bit():
    fun = lambda x: (rosen(x), rosen_der(x))  # noqa: E731
    first = minimise(fun, np.full(8, 0.3))
    second = minimise(fun, np.full(8, 0.3))
    np.testing.assert_array_equal(first[0], second[0])
    assert first[2:] == second[2:]


def test_a_line_that_keeps_descending_is_extrapolated_not_crawled():
    """A line whose slope steepens, then flattens at -200 (a concave start: the cubic puts
    its minimum behind each trial): each step goes to a + 4 (a - a_prev), as MINPACK's, to
    an acceptable step in 4 evaluations (scipy: 5); clipping the cubic's answer to just
    beyond the last trial once crawled 1.1x a trial and spent all 20."""

    def fun(x):
        a = float(x[0])
        v, g = -(a**3 + 4.5 * a**2 + 6 * a), -(3 * a * a + 9 * a + 6)
        t = math.tanh(-v / 200)
        return Evaluation(-200 * t, np.array([(1 - t * t) * g]))

    x = np.zeros(1)
    at = fun(x)
    _, found, spent = line_search(fun, x, at, np.ones(1), float(at.g[0]), 1 / 6, 20)
    assert spent <= 6 and found.f < -199
    assert abs(float(found.g[0])) <= CURVATURE * abs(float(at.g[0]))


def test_a_trial_where_the_loss_is_not_finite_is_a_step_too_far():
    """NaN beyond x = 0.5 (an overflow): the search shortens the step instead of taking
    the NaN as a decrease."""

    def fun(x):
        if x[0] > 0.5:
            return Evaluation(math.nan, np.array([math.nan]))
        return Evaluation(float((x[0] - 3) ** 2), np.array([2 * (x[0] - 3)]))

    solver = LBFGS(fun, 1e-8)
    x = np.zeros(1)
    step = solver.step(x, solver.start(x))
    assert step.moved and 0 < step.x[0] <= 0.5 and math.isfinite(step.at.f)


def test_the_memory_bounds_the_pairs_kept():
    for memory in (1, 3):
        solver = LBFGS(lambda x: Evaluation(float(x @ x), 2 * x), 0.0, memory=memory)
        x = np.arange(1.0, 6.0)
        at = solver.start(x)
        for _ in range(6):
            step = solver.step(x, at)
            x, at = step.x, step.at
            if step.stop:
                break
        assert len(solver.pairs) <= memory


def test_a_rounds_first_step_tries_the_length_it_is_given_and_later_steps_do_not():
    """Given a first length, a round's first line search evaluates x - a g first (a unit step
    along -g without one); a step with curvature pairs ignores it."""
    fun, _ = quadratic(n=5)
    x0 = np.ones(5)

    def run(second_length):
        tried = []

        def recorded(x):
            tried.append(np.array(x))
            return Evaluation(*fun(x))

        solver = LBFGS(recorded, 1e-12)
        at = solver.start(x0)
        first = solver.step(x0, at, first_length=lambda: 0.01)
        second = solver.step(first.x, first.at, first_length=second_length)
        return tried, at, first, second

    tried, at, first, second = run(None)
    np.testing.assert_allclose(tried[1], x0 - 0.01 * at.g, rtol=1e-15)
    assert first.moved
    plain = LBFGS(evaluation_of(fun), 1e-12)
    unit = plain.step(x0, plain.start(x0))  # the unit step, as before
    assert not np.allclose(unit.x, first.x)
    # with pairs the given length is ignored: the same points are tried either way
    tried_again, _, _, second_again = run(lambda: 123.0)
    assert len(tried_again) == len(tried)
    for a, b in zip(tried_again, tried, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(second_again.x, second.x)
    # a start that meets the gradient test takes no step and asks for no length
    asked = []
    done = LBFGS(evaluation_of(fun), 1e6)
    still = done.step(x0, done.start(x0), first_length=lambda: asked.append(1) or 0.01)
    assert not still.moved and still.stop == "converged" and asked == []
