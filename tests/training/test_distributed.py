"""Data-parallel evaluation (training.distributed) against one process: 2 ranks on gloo.

One spawn of two processes computes every case (spawning costs ~3 s); rank 0 saves its
answers and the test process compares them with a single-process Problem on the same data.
N = 37 is odd (shards of 19 and 18 rows) and the labels are sorted, so rank 0 has no point
of class 2 and rank 1 none of class 0.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.distributed import ProcessGroup, ShardedProblem, current_group, shard_bounds
from training.objective_registry import make_objective
from training.optimize import Monitor, Problem, run_lbfgs

OBJECTIVES = ["nca", "nca-log", "knca-majority", "knca-all"]
MODES = {"exact": None, "candidates": 4}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
N, D, DIM, N_CLASSES = 37, 6, 2, 3


def data():
    rng = np.random.default_rng(5)
    y = np.sort(rng.integers(0, N_CLASSES, N))
    y[:3], y[-3:] = 0, 2  # classes 0 and 2 present, each on one rank only
    X = rng.normal(size=(N, D)) + y[:, None] * 0.7
    theta = rng.normal(size=(DIM, D)).ravel() * 0.6
    return X, y, theta


def problem_for(X, y, name, n_candidates, dtype, group=None, chunk_size=None):
    objective = make_objective(name, k=1 if name.startswith("nca") else 3, n_classes=N_CLASSES)
    kwargs = dict(
        transform="linear", n_components=DIM, n_candidates=n_candidates, chunk_size=chunk_size
    )
    labels = torch.as_tensor(y)
    if group is None:
        return Problem(torch.as_tensor(X, dtype=dtype), labels, objective, **kwargs)
    start, stop = shard_bounds(len(X), group.rank, group.world_size)
    shard = torch.as_tensor(X[start:stop], dtype=dtype)
    return ShardedProblem(shard, labels, objective, group=group, **kwargs)


def evaluate_all(X, y, theta, group=None):
    """{case: (loss, grad)} for every objective, mode and dtype; plus a short fit."""
    out = {}
    for name in OBJECTIVES:
        for mode, n_candidates in MODES.items():
            for dtype_name, dtype in DTYPES.items():
                # chunks of 5 rows: smaller than either shard, and than the chunk default
                problem = problem_for(X, y, name, n_candidates, dtype, group, chunk_size=5)
                if n_candidates is not None:
                    problem.refresh_candidates(theta)
                loss, grad, _ = problem.loss_and_grad(theta)
                out[f"{name}/{mode}/{dtype_name}"] = np.r_[loss, grad]
    for mode, n_candidates in MODES.items():
        problem = problem_for(X, y, "nca", n_candidates, torch.float64, group)
        monitor = Monitor(max_iter=12, validate=None, early_stopping=False)
        result = run_lbfgs(problem, theta, max_iter=12, tol=1e-9, monitor=monitor, refresh_every=4)
        out[f"fit/{mode}"] = np.r_[result.n_iter, result.theta]
    return out


def _worker(rank: int, world_size: int, rendezvous: str, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    try:
        group = current_group()
        assert group == ProcessGroup(rank, world_size, "gloo")
        X, y, theta = data()
        out = evaluate_all(X, y, theta, group)
        if rank == 0:
            np.savez(result_path, **{k.replace("/", "__"): v for k, v in out.items()})
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    result_path = str(tmp / "rank0.npz")
    rendezvous = f"file://{tmp / 'rendezvous'}"
    mp.spawn(_worker, args=(2, rendezvous, result_path), nprocs=2, join=True)
    with np.load(result_path) as saved:
        return {k.replace("__", "/"): saved[k] for k in saved.files}


@pytest.fixture(scope="module")
def one_process():
    X, y, theta = data()
    return evaluate_all(X, y, theta)


def test_shards_cover_every_row_once_and_differ_by_at_most_one():
    for n, p in [(37, 2), (10, 3), (3, 4), (0, 2)]:
        bounds = [shard_bounds(n, r, p) for r in range(p)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [stop - start for start, stop in bounds]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="rank must be in"):
        shard_bounds(10, 2, 2)


def test_single_process_group_without_torchrun():
    assert current_group() == ProcessGroup(0, 1, "none")
    assert not current_group().is_distributed


def test_shard_of_the_wrong_size_is_refused():
    X, y, _ = data()
    with pytest.raises(ValueError, match=r"rank 0 of 1 must hold rows \[0, 37\)"):
        ShardedProblem(
            torch.as_tensor(X[:10]),
            torch.as_tensor(y),
            make_objective("nca"),
            group=ProcessGroup(),
            transform="linear",
            n_components=DIM,
        )


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_two_ranks_give_the_single_process_objective_and_gradient(
    two_ranks, one_process, name, mode, dtype_name
):
    key = f"{name}/{mode}/{dtype_name}"
    got, expected = two_ranks[key], one_process[key]
    rtol = 1e-10 if dtype_name == "float64" else 1e-5
    assert got[0] == pytest.approx(expected[0], rel=rtol)
    scale = np.abs(expected[1:]).max()
    np.testing.assert_allclose(got[1:], expected[1:], rtol=rtol, atol=rtol * scale)
    assert np.abs(expected[1:]).max() > 0


@pytest.mark.parametrize("mode", MODES)
def test_a_short_fit_on_two_ranks_ends_at_the_single_process_parameters(
    two_ranks, one_process, mode
):
    got, expected = two_ranks[f"fit/{mode}"], one_process[f"fit/{mode}"]
    assert got[0] == expected[0]  # the same number of iterations
    # float64 sums in another order: 1e-12 relative per evaluation, grown by 12 L-BFGS steps
    np.testing.assert_allclose(got[1:], expected[1:], rtol=1e-7, atol=1e-9)
    assert not np.allclose(expected[1:], data()[2])  # the fit moved


def test_spawned_ranks_do_not_leak_into_this_process():
    assert not (dist.is_available() and dist.is_initialized())
    assert "RANK" not in os.environ or os.environ.get("WORLD_SIZE") == "1"
