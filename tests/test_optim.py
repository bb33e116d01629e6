"""The flat optimizer's weight-decay mask, laid out as ZeRO-1 buckets lay out parameters."""
import numpy as np

from megascale_jax.optim import flat_decay_mask


def test_flat_decay_mask_marks_matrix_elements_and_leaves_padding_undecayed():
    # a matrix piece of 3 elements, a vector of 2, a 3-d piece of 4, then 3 elements of padding
    mask = flat_decay_mask([(2, 3), (1, 2), (3, 4)], 12)
    assert mask.dtype == np.uint8
    np.testing.assert_array_equal(mask, [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0])
