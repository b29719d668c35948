"""benchmarks/real_digits.py's shifted digits: each training image and its copies moved
one pixel up, down, left and right (and along the diagonals) with zero fill, labels
repeated."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_digits import DIAGONALS, SHIFTS, shifted_digits, twin_free_split  # noqa: E402


@pytest.mark.parametrize("shifts", [SHIFTS, SHIFTS + DIAGONALS])
def test_each_copy_is_its_image_moved_one_pixel_with_zero_fill(shifts):
    rng = np.random.default_rng(0)
    X = rng.random((3, 784), dtype=np.float32) + 0.5  # no zero pixel of its own
    y = np.array([7, 1, 4])
    moved, labels = shifted_digits(X, y, shifts)
    copies = 1 + len(shifts)
    assert moved.shape == (3 * copies, 784) and moved.dtype == X.dtype
    np.testing.assert_array_equal(labels, np.tile(y, copies))
    np.testing.assert_array_equal(moved[:3], X)
    images = X.reshape(3, 28, 28)
    for copy, (dy, dx) in enumerate(shifts, start=1):
        out = moved[3 * copy : 3 * copy + 3].reshape(3, 28, 28)
        for r in range(28):
            for c in range(28):
                r0, c0 = r - dy, c - dx  # the source pixel of (r, c)
                inside = 0 <= r0 < 28 and 0 <= c0 < 28
                expected = images[:, r0, c0] if inside else np.zeros(3, np.float32)
                np.testing.assert_array_equal(out[:, r, c], expected)


def test_rows_that_are_not_28_x_28_images_are_refused():
    with pytest.raises(ValueError, match=r"rows of 784, got \(4, 392\)"):
        shifted_digits(np.zeros((4, 392), np.float32), np.zeros(4, np.int64))


def test_the_judged_split_leaves_no_twin_of_a_validation_row_among_the_training_rows():
    rng = np.random.default_rng(1)
    X = rng.random((50, 784), dtype=np.float32) + 0.5  # distinct images, no zero pixel
    y = rng.integers(0, 10, 50)
    split = twin_free_split(X, y, judged=8)
    assert split["X_val"].shape == (8, 784) and split["X"].shape == (42 * (1 + len(SHIFTS)), 784)
    held = [int(np.flatnonzero((X == row).all(1))[0]) for row in split["X_val"]]
    np.testing.assert_array_equal(split["y_val"], y[held])
    twins, _ = shifted_digits(split["X_val"], split["y_val"])  # each validation row, moved
    training = {row.tobytes() for row in split["X"]}
    assert not any(row.tobytes() in training for row in twins)
    originals = {row.tobytes() for row in X} - {row.tobytes() for row in split["X_val"]}
    assert originals <= training  # every other digit is a training row, with its copies
