"""Shared by the tests of hypershard's fused ops (hypershard.ops): element-wise error-bound checks
against a float64 reference, and stand-ins for torch_npu's op schemas (to prove that the rules
registered under torch_npu's names serve them where torch_npu itself is absent)."""

from __future__ import annotations

import torch

__all__ = ["assert_within", "define_npu_standins", "has_npu_op"]

# Stand-in libraries live as long as the process: defining an op twice (a test file run twice
# in one process) would fail, and dropping them while torch.ops.npu still holds their packets
# would leave stale handles.
_NPU_LIBRARIES: list = []


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """Every element of `got` within its own bound of the float64 `ref` (and the same shape)."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = (got.to(torch.float64) - ref).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    if bool(bad.any()):
        index = int(torch.argmax(torch.where(bad, err / bound.clamp_min(1e-300), torch.zeros_like(err))))
        flat_got, flat_ref, flat_bound = got.to(torch.float64).flatten(), ref.flatten(), bound.flatten()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond their error bound; worst at flat index "
            f"{index}: got {flat_got[index].item()!r}, reference {flat_ref[index].item()!r}, "
            f"|err| {err.flatten()[index].item():.3e} > bound {flat_bound[index].item():.3e}")


def has_npu_op(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"npu::{name}", "")
        return True
    except RuntimeError:
        return False


def define_npu_standins(schemas: dict):
    """torch.ops.npu with these ops ({name: schema}) defined where they are missing (no kernels),
    hypershard's runtime told of them; returns torch.ops.npu."""
    import hypershard as hs

    missing = [name for name in schemas if not has_npu_op(name)]
    if missing:
        try:
            library = torch.library.Library("npu", "DEF")
        except RuntimeError:  # the namespace is defined already (torch_npu or another test)
            library = torch.library.Library("npu", "FRAGMENT")
        for name in missing:
            library.define(schemas[name])
        _NPU_LIBRARIES.append(library)
    hs._C.sync_registrations()  # hypershard's runtime learns of ops registered after it loaded
    assert all(has_npu_op(name) for name in schemas)
    return torch.ops.npu
