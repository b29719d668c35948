"""The fused attention form of exact NCA (training/objectives/nca_flex.py) against the torch
path, on the CPU through flex_attention's eager reference (the CUDA twin is in test_cuda.py).

Float64 agrees to 1e-12. In float32 the value agrees to 1e-6; the gradient to 1e-5 of its
largest entry, because f's gradient is a difference of nearly equal sums (each row of W sums
to zero) and the torch path itself is 2.5e-6 off the float64 gradient on these sets.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from training.objectives import nca_flex
from training.objectives.nca_kernel import nca_value_and_grad

pytestmark = [
    pytest.mark.skipif(not nca_flex.flex_available(), reason="no flex_attention in this torch"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # eager flex_attention says it is slow
]

TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.float64: (1e-12, 1e-12)}  # value, gradient


def shuffled_classes(sizes, seed=0):
    """Labels with the given class sizes in a random order (the kernel sorts them)."""
    labels = np.repeat(np.arange(len(sizes)), sizes)
    return torch.as_tensor(np.random.default_rng(seed).permutation(labels))


def embeddings(n, d, dtype, seed=1, spread=1.0):
    return torch.as_tensor(np.random.default_rng(seed).normal(0, spread, (n, d)), dtype=dtype)


def assert_close(fused, reference, dtype):
    value_tol, grad_tol = TOLERANCE[dtype]
    assert float(fused[0]) == pytest.approx(float(reference[0]), rel=value_tol)
    scale = float(reference[1].abs().max())
    assert float((fused[1] - reference[1]).abs().max()) <= grad_tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("log_form", [False, True])
@pytest.mark.parametrize(
    "sizes",
    [
        [150, 150],  # two classes, the boundary inside a 128-row tile
        [7, 150, 1, 142],  # a class of one (scores 0) and one smaller than a tile
        [60, 61, 62, 63, 64, 65],  # every tile spans classes
    ],
)
def test_fused_passes_equal_the_torch_path(dtype, log_form, sizes):
    labels = shuffled_classes(sizes)
    z = embeddings(len(labels), 5, dtype)
    reference = nca_value_and_grad(z, labels, log_form=log_form, flex=False)
    fused = nca_value_and_grad(z, labels, log_form=log_form, flex=True)
    assert_close(fused, reference, dtype)


@pytest.mark.parametrize("log_form", [False, True])
def test_query_rows_subset_and_repeats_equal_the_torch_path(log_form):
    labels = shuffled_classes([90, 120, 100], seed=3)
    z = embeddings(len(labels), 4, torch.float64, seed=4)
    rows = torch.tensor([0, 5, 5, 17, 200, 301, 64, 128, 129])  # 5 counts twice
    reference = nca_value_and_grad(z, labels, log_form=log_form, rows=rows, flex=False)
    fused = nca_value_and_grad(z, labels, log_form=log_form, rows=rows, flex=True)
    assert_close(fused, reference, torch.float64)


def test_g_stays_exact_where_p_i_is_below_float_range():
    """Two far-apart pairs of classes: p_i ~ e^-400 underflows as a probability, but
    log p_i = lse_same - lse_all is exact, as in the torch path's same-class maximum."""
    labels = torch.tensor([0, 1, 0, 1])
    z = torch.tensor([[0.0], [0.1], [20.0], [20.1]], dtype=torch.float64)
    reference = nca_value_and_grad(z, labels, log_form=True, flex=False)
    fused = nca_value_and_grad(z, labels, log_form=True, flex=True)
    assert np.isfinite(float(fused[0])) and float(fused[0]) < -300
    assert_close(fused, reference, torch.float64)


def test_gradient_matches_central_finite_differences():
    labels = shuffled_classes([20, 25, 15], seed=5)
    z = embeddings(len(labels), 3, torch.float64, seed=6)
    _, grad = nca_value_and_grad(z, labels, log_form=False, flex=True)
    step = 1e-6
    for i, k in [(0, 0), (13, 2), (59, 1), (30, 0)]:
        up, down = z.clone(), z.clone()
        up[i, k] += step
        down[i, k] -= step
        numeric = (
            float(nca_value_and_grad(up, labels, log_form=False, flex=True)[0])
            - float(nca_value_and_grad(down, labels, log_form=False, flex=True)[0])
        ) / (2 * step)
        assert float(grad[i, k]) == pytest.approx(numeric, rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("sizes", [[300], [5, 400, 3, 250], [129, 127, 1, 256]])
def test_same_class_block_mask_lists_every_tile_a_pair_needs(sizes):
    """Every same-class, off-diagonal pair (a, b) falls in a listed key tile of a's query tile,
    and no listed tile lies outside the classes of its query tile."""
    classes = torch.as_tensor(np.repeat(np.arange(len(sizes)), sizes))
    n = len(classes)
    positions = torch.arange(n)
    mask = nca_flex.same_class_block_mask(classes, positions, classes, positions)
    counts = mask.kv_num_blocks[0, 0]
    listed = {
        (qb, int(kb))
        for qb in range(len(counts))
        for kb in mask.kv_indices[0, 0, qb, : int(counts[qb])]
    }
    block = nca_flex.BLOCK
    same = (classes[:, None] == classes[None, :]) & ~torch.eye(n, dtype=torch.bool)
    # the (query tile, key tile) of every such pair: the block x block tiles of `same` that
    # hold one (found tile by tile, not pair by pair: 222k pairs in the second case)
    tiles = -(-n // block)
    padded = torch.zeros((tiles * block, tiles * block), dtype=torch.bool)
    padded[:n, :n] = same
    holding = padded.view(tiles, block, tiles, block).any(dim=3).any(dim=1)
    needed = set(map(tuple, torch.nonzero(holding).tolist()))
    assert needed <= listed
    for qb, kb in listed:
        q_classes = set(classes[qb * block : (qb + 1) * block].tolist())
        k_classes = set(classes[kb * block : (kb + 1) * block].tolist())
        assert q_classes & k_classes


def test_a_kernel_failure_falls_back_to_the_torch_path_with_one_warning(monkeypatch):
    labels = shuffled_classes([30, 30])
    z = embeddings(60, 3, torch.float64)

    def broken(*args, **kwargs):
        raise RuntimeError("no Triton for this card")

    monkeypatch.setattr(nca_flex, "exact_value_and_grad", broken)
    monkeypatch.setattr(nca_flex, "_failed", [])
    with pytest.warns(RuntimeWarning, match="no Triton for this card"):
        fused = nca_value_and_grad(z, labels, log_form=False, flex=True)
    reference = nca_value_and_grad(z, labels, log_form=False, flex=False)
    assert float(fused[0]) == float(reference[0])
    assert torch.equal(fused[1], reference[1])
    assert len(nca_flex._failed) == 1  # usable() is False from now on in this process
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a second call does not warn again
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert not nca_flex.usable(z)


def test_usable_only_for_float32_on_cuda(monkeypatch):
    z = torch.zeros(4, 2)
    assert not nca_flex.usable(z)  # the CPU runs the torch path
    monkeypatch.setenv("NCA_KNN_FLEX", "0")
    assert not nca_flex.usable(z)
