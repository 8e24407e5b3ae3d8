"""The metric functions on tiny hand-built tensors, against values worked out by hand or by struct/hashlib."""

import hashlib
import math
import struct

import pytest
import torch

from harness.judging.compare import (
    bit_patterns,
    locate,
    max_abs_diff,
    mismatched,
    nonfinite,
    rel_l2,
    sha256,
    ulp_distance,
)
from tests.compare_expectations import f32_bits

pytestmark = pytest.mark.cpu


def test_max_abs_diff_and_rel_l2_values():
    empty = torch.zeros(0)
    assert max_abs_diff(empty, empty) == 0.0 and isinstance(max_abs_diff(empty, empty), float)
    assert max_abs_diff(torch.tensor([1.0]), torch.tensor([3.0])) == 2.0
    assert max_abs_diff(torch.tensor([1.0, -1.0]), torch.tensor([0.5, 1.0])) == 2.0
    assert max_abs_diff(torch.tensor([1.0, math.inf]), torch.tensor([1.0, 2.0])) == math.inf
    assert max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, math.nan])) == math.inf
    assert max_abs_diff(torch.tensor([True, False]), torch.tensor([True, True])) == 1.0  # masks compare too
    assert rel_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_l2(torch.ones(2), torch.zeros(2)) == math.inf
    assert rel_l2(torch.tensor([1.5]), torch.tensor([1.0])) == 0.5  # ||b|| == 1
    assert rel_l2(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 3.0])) == pytest.approx(2 / math.sqrt(10), rel=1e-15)
    assert rel_l2(torch.tensor([True, False]), torch.tensor([True, True])) == pytest.approx(1 / math.sqrt(2), rel=1e-15)
    # float32 inputs are normed in float64: the reference route is Python's float arithmetic
    a, b = torch.tensor([0.1, 0.7, 1.3]), torch.tensor([0.2, 0.3, 1.1])
    av, bv = a.tolist(), b.tolist()
    want = math.sqrt(sum((x - y) ** 2 for x, y in zip(av, bv, strict=True))) / math.sqrt(sum(y * y for y in bv))
    assert rel_l2(a, b) == pytest.approx(want, rel=1e-13)
    for metric in (max_abs_diff, rel_l2):
        with pytest.raises(ValueError, match=r"shape mismatch: actual \(2,\) vs expected \(1,\)"):
            metric(torch.zeros(2), torch.zeros(1))


def test_ulp_distance_in_int_order_of_each_dtype():
    one = torch.tensor([1.0])
    above = (one.view(torch.int32) + 1).view(torch.float32)  # the next float32 above 1.0
    tiny = torch.tensor([1], dtype=torch.int32).view(torch.float32)  # the smallest positive subnormal
    assert tiny.item() > 0 and ulp_distance(tiny, torch.tensor([0.0])).tolist() == [1]
    assert ulp_distance(torch.tensor([0.0]), tiny).tolist() == [1]
    assert ulp_distance(one, above).tolist() == [1] and ulp_distance(above, one).tolist() == [1]
    assert ulp_distance(-one, one).tolist() == [2 * f32_bits(1.0)]
    assert ulp_distance(-one, one).dtype == torch.int64
    bf = torch.tensor([1.0, -1.0, -0.0], dtype=torch.bfloat16)
    assert ulp_distance(bf, -bf).tolist() == [2 * 0x3F80, 2 * 0x3F80, 0]
    with pytest.raises(ValueError, match=r"shape mismatch: actual \(2,\) vs expected \(1,\)"):
        ulp_distance(torch.zeros(2), torch.zeros(1))
    grid = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(ulp_distance(grid.t(), grid.t().contiguous()), torch.zeros(3, 2, dtype=torch.int64))
    assert ulp_distance(grid.t() + 1, grid.t()).tolist() == [
        [f32_bits(i + 1.0) - f32_bits(float(i)) for i in row] for row in grid.t().tolist()]


def test_bit_patterns_mismatched_and_nonfinite():
    mask = bit_patterns(torch.tensor([True, False]))
    assert mask.dtype == torch.uint8 and mask.tolist() == [1, 0]
    assert bit_patterns(torch.tensor([-0.0, 1.0])).tolist() == [f32_bits(-0.0), f32_bits(1.0)]
    assert bit_patterns(torch.tensor([1.0 + 2.0j])).tolist() == [[f32_bits(1.0), f32_bits(2.0)]]
    assert mismatched(torch.zeros(3), torch.zeros(3, dtype=torch.float64)) == 3
    wide = bit_patterns(torch.tensor([-0.0, 1.0], dtype=torch.float64))
    assert wide.dtype == torch.int64 and wide.tolist() == [-(2**63), 0x3FF0000000000000]
    assert bit_patterns(torch.tensor([1.0], requires_grad=True)).tolist() == [f32_bits(1.0)]
    half = bit_patterns(torch.tensor([-2.0], dtype=torch.float16))
    byte = bit_patterns(torch.tensor([-1], dtype=torch.int8))
    assert (half.dtype, half.tolist(), byte.dtype, byte.tolist()) == (torch.int16, [-0x4000], torch.uint8, [255])
    assert mismatched(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([-0.0, 1.0, 3.0])) == 2
    with pytest.raises(ValueError, match=r"shape mismatch: actual \(2,\) vs expected \(1,\)"):
        mismatched(torch.zeros(2), torch.zeros(1))
    assert nonfinite(torch.tensor([1, 2])) == 0
    assert nonfinite(torch.tensor([math.nan, 1.0, -math.inf, math.inf])) == 3


def test_sha256_hashes_dtype_shape_and_bytes_in_logical_order():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    transposed = x.t()  # strides (1, 2): bytes must still be read in row-major order of the view
    raw = struct.pack("<4f", 1.0, 3.0, 2.0, 4.0)
    assert sha256(transposed) == hashlib.sha256(b"torch.float32:(2, 2):" + raw).hexdigest()
    assert sha256(torch.zeros(0)) == hashlib.sha256(b"torch.float32:(0,):").hexdigest()
    assert sha256(x.clone().requires_grad_()) == sha256(x)  # a tensor in a graph hashes like its values


def test_locate_names_dims_labels_and_the_rest():
    assert locate(5, (2, 3), ("row",)) == "row 1, element (2,)"
    assert locate(1, (2,), ("row",)) == "row 1"
    assert locate(4, (2, 3), ("row", "step"), {"step": [5, 9, 17]}) == "row 1, step 9"
    assert locate(3, (4,)) == "element (3,)"
    assert locate(0, ()) == "scalar"
