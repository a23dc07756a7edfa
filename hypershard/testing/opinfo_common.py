"""What the OpInfo sweep's forward variants (hypershard.testing.opinfo_sweep) and its gradient
variant (hypershard.testing.opinfo_grad) share: the variant names, the tolerances, and how a
sample's tensors are copied, distributed, gathered and compared. One module, so that the sweep can
import the gradient variant and the gradient variant these helpers without an import circle.
"""

from __future__ import annotations

from typing import Any

VARIANTS = ("replicate", "sharded")  # forward: the op's outputs compared
GRAD_VARIANT = "grad"  # backward: input gradients compared, inputs sharded (ops that support autograd)
# forward on a 2-D (2, world/2) mesh ("dp", "tp"): the largest dim over dp, the next largest
# (or, when no other dim has 2 elements, the same one, nested) over tp -- needs an even world >= 4
MESH_2D_VARIANT = "sharded_2d"
ALL_VARIANTS = (*VARIANTS, GRAD_VARIANT, MESH_2D_VARIANT)
# Ops whose outputs are uninitialized memory: only shape and dtype can be compared (torch's own
# DTensor sweep skips them for the same reason).
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})
# assert_close's float32 defaults, which torch's own DTensor sweep uses. A fallback result is the
# same kernel on the same gathered values (bitwise equal); a rule result differs only where a
# reduction is split over shards (a reordered sum of at most a few dozen sample values). Checked:
# the same pass/fail for every pair with ATen's scalar kernels and MKL's SSE4.2 path.
RTOL, ATOL = 1.3e-6, 1e-5


def op_key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def map_tensors(value: Any, convert) -> Any:
    """`value` with convert(t) in place of every tensor t in its lists, tuples and dicts (the
    shapes an OpInfo sample's arguments take)."""
    import torch

    if isinstance(value, torch.Tensor):
        return convert(value)
    if isinstance(value, (list, tuple)):
        converted = [map_tensors(v, convert) for v in value]
        return type(value)(converted) if isinstance(value, tuple) else converted
    if isinstance(value, dict):
        return {k: map_tensors(v, convert) for k, v in value.items()}
    return value


def distribute_tensor(tensor, mesh, variant: str):
    import torch

    import hypershard as hs

    if tensor.layout != torch.strided:  # sparse ones stay plain
        return tensor
    placements = [hs.Replicate()] * mesh.ndim
    if variant in ("sharded", MESH_2D_VARIANT) and tensor.dim() > 0 and tensor.numel() > 0:
        by_size = sorted(range(tensor.dim()), key=lambda d: -tensor.shape[d])  # stable: ties keep dim order
        placements[0] = hs.Shard(by_size[0])
        if variant == MESH_2D_VARIANT:
            second = by_size[1] if len(by_size) > 1 and tensor.shape[by_size[1]] >= 2 else by_size[0]
            placements[1] = hs.Shard(second)
    return hs.distribute_tensor(tensor, mesh, placements)


def distribute(value: Any, mesh, variant: str):
    return map_tensors(value, lambda t: distribute_tensor(t, mesh, variant))


def fresh_copy(value: Any):
    import torch

    return map_tensors(value, lambda t: t.detach().clone() if t.layout == torch.strided else t)


def gather(value: Any):
    import torch

    import hypershard as hs

    if isinstance(value, torch.Tensor):
        return value.full_tensor() if hs._C.is_dtensor(value) else value
    if isinstance(value, (list, tuple)):
        return type(value)(gather(v) for v in value) if isinstance(value, tuple) else [gather(v) for v in value]
    return value


def compare(got: Any, expected: Any, values: bool = True) -> None:
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"got {type(got).__name__}, expected a tensor"
        if not values:
            assert (got.shape, got.dtype) == (expected.shape, expected.dtype), (
                f"{tuple(got.shape)} {got.dtype} vs {tuple(expected.shape)} {expected.dtype}"
            )
            return
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, equal_nan=True, check_stride=False)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), "output structure differs"
        for g, e in zip(got, expected):
            compare(g, e, values)
    elif isinstance(expected, float) and isinstance(got, float):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, equal_nan=True)
    else:
        assert got == expected, f"{got!r} != {expected!r}"


def describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
