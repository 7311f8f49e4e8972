"""l2_normalize_rows: unit rows in float32, and the two answers to a row without a direction."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval.utils.unit_rows import l2_normalize_rows


def test_rows_come_back_unit_length_float32_and_contiguous():
    rows = np.random.default_rng(0).standard_normal((5, 7)) * [[1], [10], [0.1], [3], [1e-3]]
    unit = l2_normalize_rows(np.asfortranarray(rows))  # not C-contiguous
    assert unit.dtype == np.float32 and unit.flags.c_contiguous
    assert np.allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
    assert np.allclose(unit, rows / np.linalg.norm(rows, axis=1, keepdims=True), atol=1e-6)
    assert np.array_equal(l2_normalize_rows(rows, zero_rows="keep"), unit)


def test_a_zero_row_is_refused_by_default_and_kept_zero_when_asked():
    rows = np.array([[3.0, 4.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="all zeros or not finite"):
        l2_normalize_rows(rows)
    with pytest.raises(ValueError, match="all zeros or not finite"):
        l2_normalize_rows(np.array([[np.nan, 1.0]]))
    kept = l2_normalize_rows(rows, zero_rows="keep")
    assert np.allclose(kept, [[0.6, 0.8], [0.0, 0.0]]) and np.isfinite(kept).all()


def test_a_wrong_shape_or_mode_is_named():
    with pytest.raises(ValueError, match="2-D array"):
        l2_normalize_rows(np.ones(3))
    with pytest.raises(ValueError, match="zero_rows must be one of"):
        l2_normalize_rows(np.ones((2, 2)), zero_rows="zero")
