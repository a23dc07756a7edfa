"""The planner's parts without processes: a simulated mesh records collectives per axis with
hypershard's byte count, the storage accounting sees params / grads / optimizer state exactly,
and a plan over budget names its classes."""

import torch

from hypershard import _C
from hypershard.planner.cli import format_report, main
from hypershard.planner.memory import LiveBytes
from hypershard.planner.run import _watch_fully_shard, plan_step
from hypershard.planner.step import load_config
from hypershard.planner.world import coordinates, recording, simulated_mesh
from hypershard.testing.models import TINY_CONFIGS


def test_coordinates_row_major():
    assert coordinates({"dp": 4, "tp": 2}, 5) == [2, 1]
    assert coordinates({"dp": 2, "ep": 2, "tp": 2}, 6) == [1, 1, 0]


def test_recorded_collectives_per_axis():
    import hypershard as hs

    mesh = simulated_mesh({"dp": 4, "tp": 2}, rank=3)
    layout = hs.make_layout(mesh.mesh, [8, 6], ["S(0)", "S(1)"])
    x = _C.from_local(torch.empty(layout.local_shape_at(mesh.position), device="meta"), mesh, layout)
    with recording() as log:
        before = _C.traffic()["bytes_sent"]
        y = x.redistribute(mesh, [hs.Replicate(), hs.Replicate()])
        sent = _C.traffic()["bytes_sent"] - before
    assert y.to_local().shape == (8, 6) and y.to_local().is_meta
    assert set(log.axis_bytes()) == {"dp", "tp"} and sum(log.axis_bytes().values()) == sent
    assert log.uncounted == 0


def test_tiny_plan_counts_state_exactly():
    config = load_config("qwen3", **TINY_CONFIGS["qwen3"])
    report = plan_step(config, {"dp": 2, "tp": 2}, batch=4, seq=16)
    assert report.gradients == report.parameters                  # fp32 grads laid out as the params
    assert abs(report.optimizer - 2 * report.parameters) <= 4 * 64  # m, v (+ 4-byte step counters)
    assert report.activations > 0 and report.peak >= report.parameters + report.activations
    assert sum(report.axis_bytes.values()) == report.traffic_bytes
    text = format_report(report, memory_per_rank=report.peak / 2)
    assert "DOES NOT FIT" in text and "largest first: activations" in text


def test_cli_exit_code_says_fit(capsys):
    assert main(["--model", "qwen3_5_0_8b", "--mesh", "dp=2,tp=2", "--seq", "64", "--layers", "4",
                 "--memory-per-rank", "1000"]) == 0
    out = capsys.readouterr().out
    assert "fits 1.0 TB per rank" in out and "tp all_reduce" in out


def test_trace_attributes_every_byte():
    config = load_config("qwen3", **TINY_CONFIGS["qwen3"])
    report = plan_step(config, {"dp": 2, "tp": 2}, batch=4, seq=16, trace=True)
    assert sum(n for *_, n in report.issuers) == report.traffic_bytes
    assert any("parallel/styles.py" in where for _, _, where, _ in report.issuers)  # the rowwise outputs' all-reduce


def test_span_exchange_bytes_go_to_their_own_collective():
    """flip / roll along a sharded dim exchange spans with one all_to_all, which hypershard counts
    right after issuing it: the log still gives it exactly its bytes, and nothing is left over."""
    import hypershard as hs

    mesh = simulated_mesh({"dp": 4, "tp": 2}, rank=1)
    layout = hs.make_layout(mesh.mesh, [64, 6], ["S(0)", "R"])
    for op in (lambda x: torch.flip(x, [0]), lambda x: torch.roll(x, 3, 0)):
        x = _C.from_local(torch.empty(layout.local_shape_at(mesh.position), device="meta"), mesh, layout)
        with recording() as log:
            before = _C.traffic()["bytes_sent"]
            op(x)
            sent = _C.traffic()["bytes_sent"] - before
        assert dict(log.counts) == {("dp", "all_to_all"): 1} and log.axis_bytes() == {"dp": sent} and sent > 0
        assert log.uncounted == 0


def test_fully_shard_backward_holds_no_extra_copy_of_a_big_gradient():
    """The reduce-scatter of one fully sharded (V, H) weight with bf16 compute and fp32 sums, N =
    V*H elements on dp=4: its backward needs the bf16 gradient (2N bytes, held by autograd), the
    fp32 send buffer of every member's rows (4N), the received fp32 shard and the .grad copy of it
    (N each): 8N. A cast copy of the whole gradient before filling the buffer (4N) or the gathered
    bf16 weight kept until after the reduce-scatter (2N) would show (14N before both were fixed:
    the 248k-vocab embedding of Qwen3.5-0.8B held 1.5 GB more per rank)."""
    import hypershard as hs

    vocab, hidden = 4096, 256
    n = vocab * hidden
    mesh = simulated_mesh({"dp": 4}, rank=0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device="meta")
    hs.fully_shard(head, mesh, mp_policy=hs.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32))
    x = torch.empty(2, hidden, device="meta")
    live = LiveBytes()
    live.know(list(head.parameters()) + [x])
    _watch_fully_shard(head, live)
    with recording(), live:
        loss = head(x).float().sum()
        live.mark("backward")
        loss.backward()
        live.mark("end")
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.float32
    peak = live.peak(start="backward", end="end")
    assert 8 * n <= peak <= 8 * n + 64 * 1024, (peak, peak / n)


# --- issue 44: the device's kernels, recomputation, the search -----------------------------------------


def _qkv(dq, dv, dtype=torch.bfloat16, heads=4, kv_heads=4, seq=64):
    q = torch.empty(1, heads, seq, dq, dtype=dtype, device="meta")
    k = torch.empty(1, kv_heads, seq, dq, dtype=dtype, device="meta")
    v = torch.empty(1, kv_heads, seq, dv, dtype=dtype, device="meta")
    return q, k, v


def test_cuda_sdpa_backend_choice():
    """torch's CUDA chooser on an H100 (cuDNN first): DeepSeek's 192 / 128 heads with a mask in bf16 take
    cuDNN (no S x S matrix), fp32 takes the efficient kernel (any head size it can align), a head
    size no fused kernel takes the math path; with flash first (older cuDNN), a masked call cannot
    take flash."""
    from hypershard.planner.world import cuda_sdpa_backend

    mask = torch.empty(1, 1, 64, 64, dtype=torch.bool, device="meta")
    assert cuda_sdpa_backend(*_qkv(192, 128), attn_mask=mask) == "cudnn"
    assert cuda_sdpa_backend(*_qkv(192, 128, torch.float32), attn_mask=mask) == "efficient"
    assert cuda_sdpa_backend(*_qkv(512, 512)) == "efficient"  # over 256: not cuDNN, not flash
    assert cuda_sdpa_backend(*_qkv(100, 100)) == "flash"  # not a multiple of 8: not cuDNN; flash pads it
    assert cuda_sdpa_backend(*_qkv(102, 102, torch.float32)) == "math"  # fp32, not a multiple of 4
    assert cuda_sdpa_backend(*_qkv(64, 64, torch.float32, heads=8, kv_heads=2), enable_gqa=True) == "math"
    flash_first = ("flash", "efficient", "math", "cudnn")
    assert cuda_sdpa_backend(*_qkv(128, 128), is_causal=True, order=flash_first) == "flash"
    assert cuda_sdpa_backend(*_qkv(128, 128), attn_mask=mask, order=flash_first) == "efficient"
    assert cuda_sdpa_backend(*_qkv(192, 128), order=flash_first) == "efficient"  # flash needs one head dim


def test_cuda_plan_takes_the_fused_kernel_and_holds_no_scores():
    """A tiny DeepSeek-V3.2 (query head 48, value head 32) at seq 64 in bf16: on CPU the math path keeps
    per-head S x S scores for backward, on CUDA the cuDNN kernel keeps out + logsumexp; the planned
    activations say so, and the kernels planned are named."""
    config = load_config("deepseek_v32", **TINY_CONFIGS["deepseek_v32"])
    kwargs = dict(batch=2, seq=64, dtype=torch.bfloat16)
    cuda = plan_step(config, {"dp": 2}, device="cuda", **kwargs)
    cpu = plan_step(config, {"dp": 2}, device="cpu", **kwargs)
    assert set(cuda.kernels) == {"sdpa cudnn"} and set(cpu.kernels) == {"sdpa math"}, (cuda.kernels, cpu.kernels)
    assert cuda.activations < cpu.activations, (cuda.activations, cpu.activations)
    assert cuda.flops > 0 and cuda.phase_flops["backward"] > cuda.phase_flops["forward"]


def _attention_saved_bytes(device, seq, heads=4, dq=48, dv=32):
    """Bytes of the distinct storages autograd saves for one attention call on meta (the planner's
    kernel for `device`), bf16, causal."""
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    q, k, v = (t.requires_grad_() for t in _qkv(dq, dv, heads=heads, kv_heads=heads, seq=seq))
    with recording(device=device) as log, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return sum(saved.values()), dict(log.kernels)


def test_npu_attention_holds_no_scores():
    """On an NPU the planner takes npu_fusion_attention (a meta stand-in): saved q, k, v, out and
    softmax_max / softmax_sum [B, N, S, 8] fp32 -- linear in S (doubling S doubles the saved bytes),
    where the CPU math path keeps S x S probabilities (doubling S nearly quadruples them)."""
    npu_s, kernels = _attention_saved_bytes("npu", 512)
    npu_2s, _ = _attention_saved_bytes("npu", 1024)
    cpu_s, _ = _attention_saved_bytes("cpu", 512)
    cpu_2s, _ = _attention_saved_bytes("cpu", 1024)
    assert kernels == {"npu_fusion_attention": 1}, kernels
    assert 0 <= 2 * npu_s - npu_2s <= 64, (npu_s, npu_2s)  # no S^2 term (16 B of rng state per call)
    assert cpu_2s > 3.5 * cpu_s, (cpu_s, cpu_2s)  # the math path's scores
    q_k_v_out = 512 * 4 * 2 * (48 + 48 + 32 + 32)  # bf16
    statistics = 2 * 512 * 4 * 8 * 4  # softmax_max + softmax_sum, fp32
    logsumexp = 512 * 4 * 4  # the stand-in kernel's (an over-count, docs/planner.md)
    assert q_k_v_out + statistics + logsumexp <= npu_s <= q_k_v_out + statistics + logsumexp + 64, npu_s


def test_npu_plan_runs_for_a_tiny_model(capsys):
    config = load_config("qwen3", **TINY_CONFIGS["qwen3"])
    report = plan_step(config, {"dp": 2, "tp": 2}, batch=4, seq=16, device="npu", dtype=torch.bfloat16)
    assert set(report.kernels) == {"npu_fusion_attention"} and report.device == "npu", report.kernels
    assert report.flops > 0 and report.activations > 0
    assert main(["--model", "qwen3_5_0_8b", "--mesh", "dp=2,tp=2", "--seq", "64", "--layers", "4",
                 "--device", "npu", "--memory-per-rank", "1000"]) == 0
    out = capsys.readouterr().out
    assert "device npu" in out and "npu_fusion_attention" in out, out
    assert "estimated step (Huawei Ascend 910B" in out, out  # --device npu: the 910B's figures by default


def test_recompute_lowers_the_peak_and_adds_the_forward_again():
    """Full recomputation keeps each layer's input only: the tiny Qwen3's activations drop and the
    backward runs every layer's forward again (more FLOPs); selective lies in between in memory."""
    config = load_config("qwen3", **dict(TINY_CONFIGS["qwen3"], num_hidden_layers=4))
    runs = {mode: plan_step(config, {"dp": 2}, batch=2, seq=64, device="cpu", recompute=mode)
            for mode in ("none", "selective", "full")}
    none, selective, full = runs["none"], runs["selective"], runs["full"]
    # (the peaks: the activations class alone moves between runs with the garbage collector, docs/planner.md)
    fb = {k: r.forward_backward_peak for k, r in runs.items()}
    assert fb["full"] < fb["selective"] < fb["none"], fb
    # selective keeps the products' and attention's outputs: its recomputation adds no counted FLOPs
    assert none.phase_flops["backward"] == selective.phase_flops["backward"] < full.phase_flops["backward"]
    assert none.phase_flops["forward"] == full.phase_flops["forward"]
    assert full.parameters == none.parameters and full.traffic_bytes == none.traffic_bytes


def test_cp_axis_is_planned_with_its_algorithm():
    config = load_config("qwen3", **TINY_CONFIGS["qwen3"])
    report = plan_step(config, {"dp": 2, "cp": 2}, batch=2, seq=64, device="cpu", cp_algorithm="ring")
    assert "cp" in report.axis_bytes and report.axis_bytes["cp"] > 0
    assert set(report.cp_calls) == {"ring"}, report.cp_calls


def test_search_prunes_what_cannot_divide_or_fit():
    from hypershard.planner.search import meshes, prune_reason

    config = load_config("deepseek_v32", **TINY_CONFIGS["deepseek_v32"])  # 4 heads, 8 experts
    for mesh in meshes(16):
        size = 1
        for n in mesh.values():
            size *= n
        assert size == 16 and list(mesh) == [a for a in ("dp", "cp", "ep", "tp") if a in mesh]
    assert len({tuple(m.items()) for m in meshes(16)}) == len(meshes(16))
    split = (8e9, 1e9)
    assert "does not divide 4 query" in prune_reason({"tp": 8}, False, config, 64, 0, split, 8)
    assert "spans nodes" in prune_reason({"tp": 16}, False, config, 64, 0, split, 8)
    assert "does not divide 8 routed experts" in prune_reason({"ep": 16}, False, config, 64, 0, split, 8)
    assert "2 x cp chunks" in prune_reason({"cp": 64}, False, config, 64, 0, split, 8)
    assert "training state" in prune_reason({"dp": 16}, False, config, 64, 80e9, split, 8)  # 16 x 9e9 > 80 GB
    assert prune_reason({"dp": 16}, True, config, 64, 80e9, split, 8) == ""  # 16 x 9e9 / 16 fits


def test_figures_scale_linearly_in_depth():
    """What the search's cut-depth model relies on: a plan's figures (peak, FLOPs, bytes per axis, state)
    grow by the same amount per added MoE layer of DeepSeek-V3.2 (tiny, fully sharded, full
    recomputation, dp=2 x ep=2): the third depth lies on the line of the first two."""
    from hypershard.planner.search import CHECKED_FIGURES, cut_depths, linear_deviation

    def plan(layers):
        config = load_config("deepseek_v32", **dict(TINY_CONFIGS["deepseek_v32"], num_hidden_layers=layers))
        return plan_step(config, {"dp": 2, "ep": 2}, batch=2, seq=32, fully_shard=True, device="cuda",
                         recompute="full", dtype=torch.float32, compute_dtype=torch.bfloat16)

    config = load_config("deepseek_v32", **dict(TINY_CONFIGS["deepseek_v32"], num_hidden_layers=6))
    d1, d2 = cut_depths(config)
    assert (d1, d2) == (3, 4)  # one dense layer first, then a MoE layer per period; two periods past it
    reports = [plan(d) for d in (d1, d2, d2 + 1)]
    deviation = linear_deviation(*reports, d1, d2, d2 + 1)
    assert max(deviation.values()) <= 1e-6, deviation
    assert set(deviation) == set(CHECKED_FIGURES) and "peak" in deviation and "flops" in deviation


def test_axis_links_and_time_estimate():
    from hypershard.planner.run import PlanReport
    from hypershard.planner.search import HARDWARE, axis_links, estimate

    assert axis_links({"dp": 32, "ep": 8}, 8) == {"dp": "inter", "ep": "intra"}
    assert axis_links({"dp": 4, "tp": 2}, 8) == {"dp": "intra", "tp": "intra"}
    assert axis_links({"dp": 2, "cp": 8, "tp": 2}, 8) == {"dp": "inter", "cp": "inter", "tp": "intra"}
    h100 = HARDWARE["h100"]
    r = PlanReport(mesh={"dp": 32, "ep": 8}, flops=int(989e12), axis_bytes={"dp": int(50e9), "ep": int(450e9)})
    e = estimate(r, h100, 0.5, tokens=4096)
    assert abs(e["compute_s"] - 2.0) < 1e-9 and abs(e["comm_s"]["dp"] - 1.0) < 1e-9 and abs(e["comm_s"]["ep"] - 1.0) < 1e-9
    assert abs(e["step_s"] - 4.0) < 1e-9 and abs(e["tokens_per_s"] - 1024) < 1e-6


def test_offload_option():
    # (HSDP is planned, not modelled: test_planner_hsdp.py)
    from hypershard.planner.run import apply_options

    config = load_config("qwen3", **TINY_CONFIGS["qwen3"])
    # a step whose peak is AdamW's (2 tokens per sequence: the state outweighs the activations)
    plain = plan_step(config, {"dp": 2}, batch=2, seq=2, device="cpu")
    off = apply_options(plan_step(config, {"dp": 2}, batch=2, seq=2, device="cpu"), offload=True)
    assert plain.peak - plain.optimizer <= off.peak < plain.peak, (off.peak, plain.peak, plain.optimizer)
    assert off.offload == off.gradients + off.parameters
