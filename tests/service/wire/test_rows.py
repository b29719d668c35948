"""Input rows (``service.wire.rows.to_rows``): the input range checked in a type that holds
the bound."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from service.errors import InvalidInput
from service.wire.rows import to_rows


def test_float16_rows_are_checked_against_the_bound_without_a_warning():
    """A float16 array against a bound past float16's range: accepted, with no 'overflow
    encountered in cast' RuntimeWarning (before: the bound was cast to float16, a stray
    warning line on a JSON log); against a bound within it, exactly (1000.5 is over 1000.25,
    which float16 would round to 1000.0)."""
    rows = np.full((2, 3), 1000.5, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = to_rows(rows, n_features=3, max_rows=4, abs_max=2.96e38)
    assert out.dtype == np.float32 and out[0, 0] == 1000.5
    with pytest.raises(InvalidInput, match="outside this model's input range"):
        to_rows(rows, n_features=3, max_rows=4, abs_max=1000.25)
