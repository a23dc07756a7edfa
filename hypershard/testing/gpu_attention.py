"""The GPU check's attention phase (hypershard/testing/gpu_check.py): each fused SDPA kernel of the
device, forward and backward, on a 1-rank hypershard mesh in strict mode against plain torch on
the same device, one row per process (a crash in one leaves the others' results).

Why a phase of its own: on the H200 (2026-12-04) every fused attention call on a DTensor died of a
segfault inside hypershard's rule (a second libstdc++ linked into hypershard._C by the machine's
compiler; CMakeLists.txt, "One C++ runtime"), while the same calls on plain tensors ran. Level0's
attention cases passed there by chance of symbol binding in forked ranks; these rows call each
kernel directly, in a fresh process, with and without dropout.

Rows: (SDPBackend name, dtype, dropout_p, placement of q/k/v). With dropout the inputs are
Replicate: the rule refuses dropout with sharded inputs (each rank would draw its own mask), and
on one rank a Replicate call draws exactly the plain call's mask from the same generator state,
so outputs and gradients must agree. In a dry run (CPU) every row uses the math backend in
float32, which checks the phase's own plumbing.
"""

from __future__ import annotations

ROWS = (
    ("EFFICIENT_ATTENTION", "float32", 0.0, "S(1)"),
    ("EFFICIENT_ATTENTION", "float32", 0.25, "R"),
    ("FLASH_ATTENTION", "bfloat16", 0.0, "S(1)"),
    ("FLASH_ATTENTION", "bfloat16", 0.25, "R"),
    ("CUDNN_ATTENTION", "bfloat16", 0.0, "S(1)"),
    ("CUDNN_ATTENTION", "bfloat16", 0.25, "R"),
)

# Same kernel, same inputs, same generator state: the results differ only where a backward kernel
# accumulates in a nondeterministic order (atomics), a few roundings of the accumulation type on
# O(1) values. Bounds: float32 1e-5 relative / 1e-5 absolute; bfloat16 two units of its rounding,
# 2^-7. A wrongly wired output (logsumexp for the output, a dropped scale, the wrong dropout draw)
# moves values by O(1).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0**-7}


def describe(index: int) -> str:
    backend, dtype, dropout, placement = ROWS[index]
    return f"{backend.lower()} {dtype} dropout {dropout} {placement}"


def run_row(index: int, device: str) -> dict:
    """Row `index` in this process: plain torch, then hypershard (strict) on a 1-rank mesh."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import hypershard as hs

    backend, dtype_name, dropout, placement = ROWS[index]
    if device == "cpu":  # dry run: the phase's plumbing on the math backend
        backend, dtype_name = "MATH", "float32"
    dtype = getattr(torch, dtype_name)
    row = {"row": describe(index), "backend": backend, "dtype": dtype_name}
    generator = torch.Generator().manual_seed(index)
    inputs = [torch.randn(2, 4, 64, 64, generator=generator).to(device, dtype) for _ in range(3)]
    cotangent = torch.randn(2, 4, 64, 64, generator=generator).to(device, dtype)

    def attend(q, k, v, cotangent_like):
        torch.manual_seed(11)  # the dropout mask: the same draw for both runs
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return out, torch.autograd.grad(out, (q, k, v), cotangent_like(out))

    plain = attend(*[t.clone().requires_grad_(True) for t in inputs], lambda out: cotangent)
    mesh = hs.init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    placements = [hs.Shard(1)] if placement == "S(1)" else [hs.Replicate()]
    with hs.strict():
        hs._C.reset_op_counts()
        got = attend(
            *[hs.distribute_tensor(t, mesh, placements).requires_grad_(True) for t in inputs],
            lambda out: hs.distribute_tensor(cotangent, out.device_mesh, out.placements),
        )
    row["ops"] = sorted(name for name, count, *_ in hs._C.op_counts() if count and "attention" in name)
    tolerance = TOLERANCE[dtype_name]
    worst = 0.0
    problems = []
    for label, g, e in zip(("output", "grad q", "grad k", "grad v"), (got[0], *got[1]), (plain[0], *plain[1])):
        g = g.full_tensor().float()
        e = e.float()
        excess = ((g - e).abs() - tolerance * (1 + e.abs())).max().item()
        worst = max(worst, (g - e).abs().max().item())
        if excess > 0:
            problems.append(f"{label} differs by {(g - e).abs().max().item():.3g}")
    row["max_abs"] = worst
    row["status"] = "failed" if problems else "passed"
    if problems:
        row["error"] = "; ".join(problems)
    return row
