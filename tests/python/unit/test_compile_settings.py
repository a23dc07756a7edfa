"""hypershard.compile's process-free decisions (hypershard/compile/): which calls run eagerly
(an empty shard on some rank: Layout.has_empty_shard), the compile settings it accepts, and the
backward it routes for transformers' grouped_mm_fallback (traced DTensors only; plain tensors keep
transformers' own)."""

import itertools

import pytest

import hypershard as hs
from hypershard.compile.api import _static_shapes
from hypershard.compile.dynamo_setup import _route_grouped_mm_fallback_backward


def _layouts():
    meshes = [hs.mesh({"dp": 2, "tp": 2}), hs.mesh({"dp": 4}), hs.mesh({"dp": 3, "tp": 2})]
    for mesh in meshes:
        names = mesh.axis_names
        for rows, columns in itertools.product(range(0, 10), (1, 3)):
            shape = [rows, columns]
            for first, second in itertools.product([(), *[(n,) for n in names], tuple(names)], repeat=2):
                if set(first) & set(second):
                    continue
                alias = tuple(("None" if not a else a[0] if len(a) == 1 else a) for a in (first, second))
                yield hs.from_alias(mesh, shape, alias)


def test_empty_shard_read_from_the_layout_matches_every_rank_local_shape():
    """Against the C++ layout's own local shapes at every rank: some rank's chunk is empty while
    the tensor is not (nested chunking included: a dim over (dp, tp))."""
    checked = found = 0
    for layout in _layouts():
        mesh = layout.mesh
        numel = 1
        for size in layout.global_shape:
            numel *= size
        locals_empty = any(0 in layout.local_shape(rank) for rank in mesh.ranks)
        expected = numel > 0 and locals_empty
        assert layout.has_empty_shard == expected, (str(layout), [layout.local_shape(r) for r in mesh.ranks])
        checked += 1
        found += expected
    assert checked == 460 and 50 < found < checked  # both answers are exercised


def test_dynamic_shapes_are_refused_and_static_is_the_default():
    assert _static_shapes({"backend": "inductor"}) == {"backend": "inductor", "dynamic": False}
    assert _static_shapes({"dynamic": None})["dynamic"] is False
    with pytest.raises(ValueError, match=r"dynamic=True: .*allowed: dynamic=False or None"):
        _static_shapes({"dynamic": True})


def test_grouped_mm_fallback_keeps_transformers_backward_for_plain_tensors():
    """After the route is installed (twice: idempotent), a plain call's gradients are transformers'
    own backward's: the same values as before the route, bit for bit (the same code runs)."""
    import torch
    import transformers.integrations.moe  # noqa: F401 -- defines the op
    from torch._library.custom_ops import OPDEFS

    def gradients():
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(7, 3, generator=gen, requires_grad=True)
        w = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
        out = torch.ops.transformers.grouped_mm_fallback(x, w, torch.tensor([4, 6], dtype=torch.int32))
        (out * out).sum().backward()
        return x.grad, w.grad

    opdef = OPDEFS["transformers::grouped_mm_fallback"]
    before = gradients()
    _route_grouped_mm_fallback_backward()
    routed = opdef._backward_fn
    assert getattr(routed, "hypershard_routes_traced", False)
    _route_grouped_mm_fallback_backward()
    assert opdef._backward_fn is routed  # installed once
    after = gradients()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert before[0][6].abs().max() == 0  # row 6 is past the last group: no gradient
