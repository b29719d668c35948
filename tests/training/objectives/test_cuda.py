"""The same code on CUDA: every evaluation path gives the CPU's values and gradients.

Skipped where no CUDA device is present (CI's machines have none); run on a GPU host with
``python -m pytest tests/training/objectives/test_cuda.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from training import NCA
from training.model.options import with_options
from training.objectives.neighbourhood import nearest_candidates, objective_sum
from training.objectives.registry import make_objective

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def blobs(n=400, n_features=10, n_classes=4, seed=0):
    rng = np.random.default_rng(seed)
    means = rng.normal(0, 1.5, (n_classes, n_features))
    y = rng.integers(0, n_classes, n)
    return means[y] + rng.normal(0, 1.0, (n, n_features)), y


def value_and_grad(z, y, objective, candidates=None):
    z = z.clone().requires_grad_(True)
    value = objective_sum(z, y, objective, candidates=candidates)
    value.backward()
    return float(value), z.grad.cpu().numpy()


@pytest.mark.parametrize(
    "name, k", [("nca", 1), ("nca-log", 1), ("knca-majority", 5), ("knca-all-log", 3)]
)
@pytest.mark.parametrize("with_candidates", [False, True])
def test_objective_and_gradient_on_cuda_equal_the_cpu(name, k, with_candidates):
    X, y = blobs()
    A = np.random.default_rng(1).normal(size=(3, X.shape[1])) * 0.5
    z_cpu = torch.tensor(X @ A.T)  # float64: the comparison is about the code, not rounding
    y_cpu = torch.tensor(y)
    objective = make_objective(name, k, n_classes=4)
    cand = nearest_candidates(z_cpu, y_cpu, 8) if with_candidates else None
    cand_gpu = cand.cuda() if with_candidates else None
    if not with_candidates and name.startswith("knca"):
        z_cpu, y_cpu = z_cpu[:60], y_cpu[:60]  # exact kNCA is O(N^2 k)
    v_cpu, g_cpu = value_and_grad(z_cpu, y_cpu, objective, cand)
    v_gpu, g_gpu = value_and_grad(z_cpu.cuda(), y_cpu.cuda(), objective, cand_gpu)
    assert v_gpu == pytest.approx(v_cpu, rel=1e-9)
    np.testing.assert_allclose(g_gpu, g_cpu, rtol=1e-7, atol=1e-10)


def test_candidates_on_cuda_equal_the_cpu():
    X, y = blobs()
    z = torch.tensor(X[:, :3])
    cpu = nearest_candidates(z, torch.tensor(y), 6)
    gpu = nearest_candidates(z.cuda(), torch.tensor(y).cuda(), 6).cpu()
    assert torch.equal(cpu, gpu)


@pytest.mark.parametrize("n_candidates", [None, 8])
def test_a_fit_on_cuda_learns_what_the_cpu_learns(n_candidates):
    X, y = blobs(600)
    params = dict(n_components=3, n_candidates=n_candidates, max_iter=15, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu = NCA(**with_options(dict(device="cpu", **params))).fit(X, y)
        gpu = NCA(**with_options(dict(device="cuda", **params))).fit(X, y)
    assert gpu.device_.startswith("cuda")
    # float32 on two devices: the optimiser's paths may part a little, the maps may not
    assert gpu.objective_value_ == pytest.approx(cpu.objective_value_, abs=0.02)
    np.testing.assert_allclose(
        gpu.transform(X), cpu.transform(X), atol=0.1 * np.abs(cpu.transform(X)).max()
    )


def _nccl_worker(rank: int, rendezvous: str, result_path: str) -> None:
    import torch.distributed as dist

    from tests.training.problems import data, evaluate_all
    from training.distributed.ranks import current_group

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=rendezvous, rank=rank, world_size=2)
    try:
        X, y, theta = data()
        out = evaluate_all(X, y, theta, current_group(), device="cuda")
        if rank == 0:
            np.savez(result_path, **{k.replace("/", "__"): v for k, v in out.items()})
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_on_nccl_give_the_single_process_values(tmp_path):
    import torch.multiprocessing as mp

    from tests.training.problems import data, evaluate_all

    mp.spawn(
        _nccl_worker,
        args=(f"file://{tmp_path / 'rdzv'}", str(tmp_path / "rank0.npz")),
        nprocs=2,
        join=True,
    )
    X, y, theta = data()
    expected = evaluate_all(X, y, theta)
    with np.load(tmp_path / "rank0.npz") as saved:
        for key, got in saved.items():
            rtol = 1e-10 if "float64" in key else 1e-5
            np.testing.assert_allclose(
                got, expected[key.replace("__", "/")], rtol=rtol, atol=rtol * 10
            )


@pytest.mark.parametrize("joint", [False, True])
def test_prototype_objective_on_cuda_equals_the_cpu(joint):
    from training.references.learned import PrototypeProblem

    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 500)
    x = rng.normal(size=(500, 12)) + y[:, None]
    a = rng.normal(size=(3, 12)) * 0.3
    labels = np.repeat(np.arange(4), 5)
    z = rng.normal(size=(20, 3))
    theta = np.concatenate([z.ravel(), a.ravel() if joint else [0.2]])
    data = x if joint else x @ a.T
    answers = [
        PrototypeProblem(
            data, y, labels, n_components=3, joint=joint, device=device, dtype=torch.float64
        ).loss_and_grad(theta)
        for device in ("cpu", "cuda")
    ]
    assert answers[1][0] == pytest.approx(answers[0][0], rel=1e-10)
    np.testing.assert_allclose(answers[1][1], answers[0][1], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("log_form", [False, True])
def test_fused_flex_kernels_on_cuda_equal_the_cpu(log_form):
    """The compiled flex_attention passes (float32 on CUDA) against the float64 torch path on
    the CPU: 3,000 points in 7 classes of unequal size, 16 dimensions, every tile spanning
    classes somewhere."""
    from training.objectives import nca_flex
    from training.objectives.nca_kernel import nca_value_and_grad

    rng = np.random.default_rng(2)
    labels = torch.as_tensor(
        rng.permutation(np.repeat(np.arange(7), [900, 700, 500, 400, 300, 150, 50]))
    )
    z64 = torch.as_tensor(rng.normal(0, 1.0, (len(labels), 16)))
    reference = nca_value_and_grad(z64, labels, log_form=log_form, flex=False)
    z = z64.float().cuda()
    assert nca_flex.usable(z)
    value, grad = nca_value_and_grad(z, labels.cuda(), log_form=log_form, flex=True)
    assert not nca_flex._failed, nca_flex._failed
    assert float(value) == pytest.approx(float(reference[0]), rel=1e-5)
    scale = float(reference[1].abs().max())
    assert float((grad.double().cpu() - reference[1]).abs().max()) <= 1e-4 * scale
