"""Level0: views of sharded tensors (forward + gradients), in-place ops on views under autograd,
AccumulateGrad, and a two-layer MLP trained with AdamW, all compared with one device."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, in_distributed_run, replicated, run_cases

MESH2 = ((2,), ("a",))
MESH3 = ((3,), ("a",))
MESH22 = ((2, 2), ("a", "b"))


def view_cases():
    cases = []
    for mesh in (MESH2, MESH3, MESH22):
        for placements in (["S(0)"], ["S(1)"], ["R"]) if mesh != MESH22 else (["S(0)", "S(1)"], ["S(1)", "S(0)"], ["S(0)", "S(0)"]):
            p = placements
            tag = f"{mesh[0]}{p}"
            x = lambda: Input((12, 8), placements=p)  # noqa: E731
            cases += [
                Case(f"t{tag}", lambda a: a.t() * 1, [x()], mesh),
                Case(f"transpose{tag}", lambda a: a.unsqueeze(0).transpose(0, 2) * 1, [x()], mesh),
                Case(f"permute{tag}", lambda a: a.reshape(12, 4, 2).permute(2, 0, 1) * 1, [x()], mesh),
                Case(f"full_slice{tag}", lambda a: a[:, :8][:12] * 1, [x()], mesh),
                Case(f"reshape_cut{tag}", lambda a: a.reshape(16, 6) * 1, [x()], mesh),
                Case(f"reshape_merge{tag}", lambda a: a.reshape(-1) * 1, [x()], mesh),
                Case(f"reshape_split{tag}", lambda a: a.reshape(4, 3, 8) * 1, [x()], mesh),
                Case(f"flatten_t{tag}", lambda a: a.t().flatten() * 1, [x()], mesh),
                Case(f"slice{tag}", lambda a: a[2:9, 1:7:2] * 1, [x()], mesh),
                Case(f"select{tag}", lambda a: a[5] * a[:, 3].sum() if False else a[5] * 1, [x()], mesh),
                Case(f"unsqueeze_squeeze{tag}", lambda a: a.unsqueeze(1).squeeze(1) * 1, [x()], mesh),
                Case(f"split{tag}", lambda a: torch.cat([s * (i + 1) for i, s in enumerate(a.split(5, dim=0))], 0), [x()], mesh),
                Case(f"chunk_dim1{tag}", lambda a: torch.stack(a.chunk(2, dim=1), 0) * 1, [x()], mesh),
                Case(f"unbind{tag}", lambda a: torch.stack(a.unbind(1)[::2], 1) * 1, [x()], mesh),
                Case(f"cat{tag}", lambda a: torch.cat([a, a * 2], dim=1), [x()], mesh),
            ]
    # 3 rows over 2 ranks: rank 1's shard has one row, which squeeze() must not drop
    cases.append(Case("squeeze_keeps_a_shard_of_one", lambda a: a.squeeze() * 1, [Input((3, 1), placements=["S(0)"])],
                      MESH2))
    cases.append(Case("squeeze_dim_keeps_a_shard_of_one", lambda a: a.squeeze(0) * 1, [Input((3, 4), placements=["S(0)"])],
                      MESH2))
    cases.append(Case("view_cut_raises", lambda a: a.view(16, 6), [Input((12, 8), placements=["S(1)"])], MESH2,
                      expect_error="would cut through a sharded dim"))
    cases.append(Case("as_strided_raises", lambda a: a.as_strided((2, 2), (1, 1)), [Input((12, 8), placements=["S(0)"])],
                      MESH2, expect_error="as_strided on a sharded tensor"))
    return cases


def inplace_on_view(a):
    # Views along the unsharded dim 1 (dim 0 is the sharded one in these cases).
    b = a * 2
    b[:, 1].mul_(3)            # CopySlices on a view of a sharded non-leaf
    b[:, 2:5].add_(b[:, 4:7])  # in-place with another view as operand
    b.t()[3].sub_(1)           # through a transposed view
    return b * b


def inplace_on_cut_view(a):
    b = a * 2
    b[2:5].add_(1)             # dim 0 is sharded: the slice cannot alias the shards
    return b


def transposed_inplace(a, z):
    b = a * 1
    b.t().mul_(z)              # the case a wrong stride policy gets silently wrong
    return b


def leaf_view_inplace(a):
    c = a.detach().clone()
    c[:, 1].fill_(7.0)
    c[:, :][:, 5:7].mul_(2)
    return c * a


def accumulate(a):
    # Two backward passes accumulate into the same .grad object, with the leaf's layout.
    (a * 2).backward(torch.ones_like(a))
    first = a.grad
    (a * a).backward(torch.ones_like(a))
    assert a.grad is first, "the second backward replaced .grad instead of accumulating into it"
    if in_distributed_run():
        assert a.grad.placements == a.placements, (a.grad.placements, a.placements)
    return a.grad.clone()


def autograd_cases():
    cases = []
    for mesh, placements in ((MESH2, ["S(0)"]), (MESH3, ["S(0)"]), (MESH22, ["S(0)", "S(0)"]), (MESH2, ["R"])):
        tag = f"{mesh[0]}{placements}"
        cases += [
            Case(f"inplace_on_view{tag}", inplace_on_view, [Input((12, 8), placements=placements)], mesh),
            Case(f"transposed_inplace{tag}", transposed_inplace,
                 [Input((12, 8), placements=placements), Input((8, 12), requires_grad=False)], mesh),
            Case(f"leaf_view_inplace{tag}", leaf_view_inplace, [Input((12, 8), placements=placements)], mesh),
            Case(f"accumulate{tag}", accumulate, [Input((12, 8), placements=placements)], mesh, check_grad=False),
        ]
        if placements != ["R"]:
            cases.append(Case(f"inplace_on_cut_view{tag}", inplace_on_cut_view, [Input((12, 8), placements=placements)],
                              mesh, expect_error="does not alias its base"))
    return cases




def mlp_train(x, w1, b1, w2, b2):
    params = [w1, b1, w2, b2]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(3):
        hidden = torch.relu(x @ w1.t() + b1)
        loss = replicated(hidden @ w2.t() + b2).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [torch.stack(losses)] + [p.detach().clone() for p in params]


def mlp_cases():
    cases = []
    # (mesh, w1, b1, w2, x): column-parallel then row-parallel (Megatron MLP), data parallel,
    # and dp x tp
    for mesh, w1p, b1p, w2p, xp in ((MESH2, ["S(0)"], ["S(0)"], ["S(1)"], ["R"]),
                                    (MESH2, ["R"], ["R"], ["R"], ["S(0)"]),
                                    (MESH22, ["R", "S(0)"], ["R", "S(0)"], ["R", "S(1)"], ["S(0)", "R"])):
        b2p = ["R"] * len(mesh[0])
        cases.append(Case(f"mlp{mesh[0]}{w1p}{xp}", mlp_train, [
            Input((8, 6), placements=xp, requires_grad=False), Input((16, 6), placements=w1p),
            Input((16,), placements=b1p), Input((4, 16), placements=w2p), Input((4,), placements=b2p)],
            mesh, check_grad=False, rtol=1e-5, atol=1e-6))
    return cases


def test_views():
    assert_all_passed(run_cases(view_cases(), backend="hypershard", timeout=600))


def test_inplace_and_accumulate():
    assert_all_passed(run_cases(autograd_cases(), backend="hypershard", timeout=300))


def test_mlp_adamw():
    assert_all_passed(run_cases(mlp_cases(), backend="hypershard", timeout=300))


def empty_tensor_cases():
    """Size-0 DTensors are ordinary tensors (shapes from PyTorch's own OpInfo samples): detach, the
    identity view, a pointwise op and an mm, with gradients, sharded on the empty dim or another."""
    out = []
    for shape, placements in (((1, 0, 3), ["S(2)"]), ((0, 5), ["S(1)"]), ((0, 5), ["S(0)"]), ((3, 0), ["S(0)"])):
        tag = f"{'x'.join(map(str, shape))}_{placements[0]}"
        x = Input(shape, placements=placements)
        out += [Case(f"empty_detach_{tag}", lambda a: a.detach() * 1, [x], MESH2),
                Case(f"empty_view_as_{tag}", lambda a: a.view_as(a), [x], MESH2),
                Case(f"empty_cos_{tag}", torch.cos, [x], MESH2)]
    out.append(Case("empty_mm_contracted", torch.mm, [Input((3, 0), placements=["S(0)"]), Input((0, 4))], MESH2))
    out.append(Case("empty_mm_rows", torch.mm, [Input((0, 6), placements=["S(1)"]), Input((6, 4), placements=["S(0)"])],
                    MESH2))
    return out


def test_empty_tensors():
    assert_all_passed(run_cases(empty_tensor_cases(), timeout=300))
