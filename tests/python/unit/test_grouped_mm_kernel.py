"""UT: hypershard::grouped_mm_local (csrc/kernels/grouped_mm.cpp), the local program of the grouped
products' rule, on plain CPU tensors and on meta / fake tensors (what a traced program sees).

Values against a float64 loop written here from the definition (group e owns rows offs[e-1]..offs[e]
of the GLOBAL cumulative ends): float64 inputs, so every product is exact up to the order of a
k-term sum (k <= 8 here: below 1e-13 relative), and rtol = atol = 1e-12 separates that from any
row or group error (O(1)). Covers the rows product with all groups and with a block of them (an
expert-parallel rank: first_group > 0, rows of other ranks' groups zero), empty groups, rows past
the last end, the weight-gradient form (2-d x 2-d, one [k, n] block per group, an empty group
zeros), out_dtype, and the argument errors. Meta and FakeTensor calls give shapes without reading
offs: the reason the op exists.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hypershard  # noqa: F401 -- defines hypershard's ops

OP = torch.ops.hypershard.grouped_mm_local.default
TIGHT = {"rtol": 1e-12, "atol": 1e-12}

# 11 rows in 4 groups; group 2 is empty, rows 10.. belong to no group
ENDS = [3, 7, 7, 10]
ROWS, K, N = 12, 5, 6


def _begin(ends, e):
    return 0 if e == 0 else ends[e - 1]


def rows_reference(x, w_all, ends, first, count):
    out = torch.zeros(x.shape[0], w_all.shape[2], dtype=x.dtype)
    for e in range(first, first + count):
        b, end = _begin(ends, e), ends[e]
        out[b:end] = x[b:end] @ w_all[e]
    return out


def contraction_reference(a, g, ends):
    out = torch.zeros(len(ends), a.shape[0], g.shape[1], dtype=a.dtype)
    for e in range(len(ends)):
        b, end = _begin(ends, e), ends[e]
        out[e] = a[:, b:end] @ g[b:end]
    return out


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, K, generator=gen, dtype=torch.float64)
    w = torch.randn(len(ENDS), K, N, generator=gen, dtype=torch.float64)
    return x, w


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("first,count", [(0, 4), (0, 2), (2, 2), (1, 1), (3, 1)])
def test_rows_of_a_block_of_groups(data, offs_dtype, first, count):
    x, w = data
    offs = torch.tensor(ENDS, dtype=offs_dtype)
    got = OP(x, w[first : first + count], offs, first)
    torch.testing.assert_close(got, rows_reference(x, w, ENDS, first, count), **TIGHT)
    assert got[ENDS[-1] :].abs().max() == 0  # rows past the last end: no group, zeros


def test_weight_gradient_form(data):
    x, _ = data
    gen = torch.Generator().manual_seed(8)
    grad = torch.randn(ROWS, N, generator=gen, dtype=torch.float64)
    got = OP(x.t(), grad, torch.tensor(ENDS))
    torch.testing.assert_close(got, contraction_reference(x.t(), grad, ENDS), **TIGHT)
    assert got[2].abs().max() == 0  # the empty group


def test_planted_fault_is_caught(data):
    """The reference check fails for a block read from the wrong first group."""
    x, w = data
    got = OP(x, w[2:4], torch.tensor(ENDS), 1)  # claims groups 1..2 while holding 2..3
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, rows_reference(x, w, ENDS, 2, 2), **TIGHT)


def test_out_dtype_widens_the_operands():
    """bfloat16 operands, a float32 result: products and sums in float32. A bfloat16 product of
    two bfloat16 values is exact in float32 (16 significant bits), so the result is the float64
    reference of the same values within float32 rounding of a 3-term sum (rtol 1e-6 = 8 ulps);
    a bfloat16 result would be off by ~4e-3."""
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(4, 3, generator=gen).bfloat16(), torch.randn(2, 3, 5, generator=gen).bfloat16()
    got = OP(x, w, torch.tensor([2, 4]), 0, torch.float32)
    assert got.dtype == torch.float32
    want = rows_reference(x.double(), w.double(), [2, 4], 0, 2)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_meta_and_fake_give_shapes_without_values():
    x, w = torch.empty(ROWS, K, device="meta"), torch.empty(2, K, N, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    assert OP(x, w, offs, 2).shape == (ROWS, N)
    assert OP(x.t(), torch.empty(ROWS, N, device="meta"), offs).shape == (4, K, N)
    with FakeTensorMode():
        fx, fw = torch.empty(ROWS, K), torch.empty(2, K, N)
        out = OP(fx, fw, torch.empty(4, dtype=torch.int32), 2)
        assert out.shape == (ROWS, N)


@pytest.mark.parametrize(
    "args,message",
    [
        ((torch.randn(3, 2, 2), torch.randn(2, 2, 2), torch.tensor([1, 3])), "takes a 2-d by 3-d or a 2-d by 2-d"),
        ((torch.randn(3, 2), torch.randn(2, 2, 2), torch.tensor([[1, 3]])), "offs must be 1-d"),
        ((torch.randn(3, 2), torch.randn(2, 2, 2), torch.tensor([1, 3]), 1), r"groups 1\.\.2 are not among offs' 2"),
    ],
)
def test_argument_errors(args, message):
    with pytest.raises(RuntimeError, match=message):
        OP(*args)
    with pytest.raises(RuntimeError, match=message):
        OP(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
