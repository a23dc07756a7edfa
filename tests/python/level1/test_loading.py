"""Level1: hs.from_pretrained loads a HuggingFace folder straight into each rank's shards.

Folders are written by transformers' own save_pretrained (per-expert MoE keys, tied embeddings
stored once) and by hypershard.checkpoint.export_hf; the reference is transformers'
from_pretrained of the same folder on one device. Per mesh kind -- dp=2 x tp=2, Qwen3.5-MoE and
DeepSeek-V3.2 on dp=2 x ep=2, fully_shard on dp=4, tp + fully_shard -- every parameter's GLOBAL value equals the
reference exactly (bytes are copied, never computed), each rank holds only its shards, and the
forward's logits equal the reference's (the harness's float32 rtol 1e-5 / atol 1e-6: only the
summation order of the sharded matmuls differs). Also: a weight missing from the files equals one
device's initialisation from the same seed; tied embeddings stay one tensor; rotary inv_freq is
computed; export_hf -> from_pretrained round trips; peak RSS per rank stays within the bound; bad
input raises the same error on every rank, before any collective.
"""

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

DP2_TP2 = ((2, 2), ("dp", "tp"))
DP2_EP2 = ((2, 2), ("dp", "ep"))
DP4 = ((4,), ("dp",))
TP4 = ((4,), ("tp",))
EP4 = ((4,), ("ep",))
SEED = 7
MISSING = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")
# A router weight (its MoE block's _init_weights draws it), a linear-attention A_log (drawn on the
# device of the tensor) and a whole fused experts weight (its 16 per-expert tensors absent).
MOE_DROPPED = ("model.layers.0.mlp.gate.weight", "model.layers.1.linear_attn.A_log",
               *(f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj")))
MOE_MISSING = ("model.layers.0.mlp.gate.weight", "model.layers.1.linear_attn.A_log",
               "model.layers.1.mlp.experts.gate_up_proj")


def _save(model_type, directory, seed=0, drop=(), **overrides):
    """transformers' save_pretrained of a tiny model (optionally without the keys in `drop`)."""
    from safetensors.torch import load_file, save_file

    from hypershard.testing.models import tiny_config, tiny_model

    model = tiny_model(tiny_config(model_type, **overrides), seed=seed)
    model.save_pretrained(directory)
    if drop:
        path = directory / "model.safetensors"
        tensors = load_file(path)
        for key in drop:
            del tensors[key]
        save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    out = {
        "qwen3": _save("qwen3", root / "qwen3"),
        "moe": _save("qwen3_5_moe_text", root / "moe"),
        "deepseek": _save("deepseek_v32", root / "deepseek"),
        "tied": _save("qwen3", root / "tied", tie_word_embeddings=True),
        "missing": _save("qwen3", root / "missing", drop=MISSING),
        "moe_missing": _save("qwen3_5_moe_text", root / "moe_missing", drop=MOE_DROPPED),
        "moe_partial": _save("qwen3_5_moe_text", root / "moe_partial",
                             drop=("model.layers.0.mlp.experts.3.up_proj.weight",)),
        "moe6": _save("qwen3_5_moe_text", root / "moe6", num_experts=6),
        "shape": _save("qwen3", root / "shape"),
    }
    config = json.loads((out["shape"] / "config.json").read_text())
    config["intermediate_size"] = 48  # the files hold 64-row MLP weights
    (out["shape"] / "config.json").write_text(json.dumps(config))
    return out


def _reference(folder, seed=None, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=dtype,
                                                attn_implementation="sdpa").eval()


def _ids(model):
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (4, 12), generator=torch.Generator().manual_seed(3))


def _logits(folder):
    def run(_dummy):
        model = _reference(folder)
        with torch.no_grad():
            return model(input_ids=_ids(model)).logits
    return run


def _check_equal(model, reference):
    import hypershard as hs

    ref = dict(reference.named_parameters(remove_duplicate=False))
    bad = []
    for name, p in model.named_parameters(remove_duplicate=False):
        full = p.full_tensor() if isinstance(p, hs.DTensor) else p
        if not torch.equal(full, ref[name].detach()):
            bad.append(name)
    assert not bad, f"parameters differ from one device's: {bad[:5]}"
    for name, b in reference.named_buffers():
        got = model.get_buffer(name)
        assert not got.is_meta and torch.equal(got, b), f"buffer {name} differs"  # inv_freq: computed


def _check_sharded(model, mesh):
    """Each rank holds only its shards: the local bytes over all parameters are the model's bytes
    split by the sharding (no rank allocated a whole tensor that is sharded)."""
    import hypershard as hs

    sharded = 0
    for name, p in model.named_parameters():
        assert isinstance(p, hs.DTensor), name
        local = p.to_local()
        layout = hs.layout_of(p)
        assert tuple(local.shape) == tuple(layout.local_shape(mesh.rank)), name
        sharded += any(layout.dim_axes)
    assert sharded, "no parameter is sharded"


def loads_like_one_device(folder, **options):
    def run(_dummy):
        import hypershard as hs

        mesh = current_mesh()
        with hs.strict():
            model = hs.from_pretrained(folder, mesh, **options)
            _check_sharded(model, mesh)
            _check_equal(model, _reference(folder))
            report = model.hs_load_report
            assert not report.initialized and any(b.endswith("rotary_emb.inv_freq") for b in report.computed_buffers)
            with torch.no_grad():
                logits = model(input_ids=_ids(model)).logits
            if options.get("fully_shard"):  # the rebuilt groups gather and reduce-scatter
                ids = _ids(model)
                model.train()
                model(input_ids=ids, labels=ids).loss.backward()
                assert all(p.grad is not None for p in model.parameters())
        return logits
    return run


def in_bfloat16(folder):
    """dtype=bfloat16: the float32 files are converted while copied, as transformers converts them."""
    def run(_dummy):
        import hypershard as hs

        model = hs.from_pretrained(folder, current_mesh(), dtype=torch.bfloat16, fully_shard=True)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        _check_equal(model, _reference(folder, dtype=torch.bfloat16))
        return torch.zeros(1)
    return run


def missing_weight_seeded(folder, missing):
    def run(_dummy):
        import hypershard as hs

        model = hs.from_pretrained(folder, current_mesh(), seed=SEED)
        assert sorted(model.hs_load_report.initialized) == sorted(missing), model.hs_load_report.initialized
        _check_equal(model, _reference(folder, seed=SEED))  # one device, same seed
        with torch.no_grad():
            return model(input_ids=_ids(model)).logits
    return run


def _seeded_logits(folder):
    def run(_dummy):
        model = _reference(folder, seed=SEED)
        with torch.no_grad():
            return model(input_ids=_ids(model)).logits
    return run


def tied_embeddings(folder):
    def run(_dummy):
        import hypershard as hs

        model = hs.from_pretrained(folder, current_mesh())
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert not model.hs_load_report.initialized
        _check_equal(model, _reference(folder))
        with torch.no_grad():
            return model(input_ids=_ids(model)).logits
    return run


def export_round_trip(folder):
    """from_pretrained -> export_hf (hypershard's HF export, per-expert keys) -> from_pretrained."""
    def run(_dummy):
        import tempfile

        import torch.distributed as dist

        import hypershard as hs
        from hypershard import checkpoint

        mesh = current_mesh()
        model = hs.from_pretrained(folder, mesh)
        root = [tempfile.mkdtemp(prefix="hs_load_export_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(root)
        checkpoint.export_hf(model, root[0], max_shard_bytes=64 << 10)  # several files and an index
        again = hs.from_pretrained(root[0], mesh, fully_shard=True)
        assert not again.hs_load_report.initialized and not again.hs_load_report.unused_keys
        _check_equal(again, _reference(folder))
        # checkpoint.load_hf: the same reads into an existing model's shards, in place
        from hypershard.testing.models import tiny_config, tiny_model
        other = hs.parallelize(tiny_model(tiny_config("qwen3_5_moe_text"), seed=5), mesh)
        checkpoint.load_hf(root[0], other)
        _check_equal(other, _reference(folder))
        with torch.no_grad():
            return again(input_ids=_ids(again)).logits
    return run


def _no_reference(_dummy):
    return None  # an error case: the harness runs no reference


def _case(name, mesh, reference, distributed, error=None):
    return Case(name, reference or _no_reference, [Input((1,), requires_grad=False)], mesh, dist_fn=distributed,
                check_grad=False, expect_error=error)


def _bad(folder, **options):
    def run(_dummy):
        import hypershard as hs

        hs.from_pretrained(folder, current_mesh(), **options)
    return run


def cases(f):
    return [
        _case("qwen3_dp2_tp2", DP2_TP2, _logits(f["qwen3"]), loads_like_one_device(f["qwen3"])),
        _case("qwen3_5_moe_dp2_ep2", DP2_EP2, _logits(f["moe"]), loads_like_one_device(f["moe"])),
        # MLA, a dense and a MoE layer, a persistent buffer (the router's e_score_correction_bias)
        _case("deepseek_v32_dp2_ep2", DP2_EP2, _logits(f["deepseek"]), loads_like_one_device(f["deepseek"])),
        _case("qwen3_dp4_fully_shard", DP4, _logits(f["qwen3"]), loads_like_one_device(f["qwen3"], fully_shard=True)),
        _case("qwen3_5_moe_dp2_tp2_fully_shard", DP2_TP2, _logits(f["moe"]),
              loads_like_one_device(f["moe"], fully_shard=True)),
        _case("qwen3_5_moe_dp2_tp2_bfloat16", DP2_TP2, lambda _dummy: torch.zeros(1), in_bfloat16(f["moe"])),
        _case("qwen3_dp2_tp2_missing_weights_seeded", DP2_TP2, _seeded_logits(f["missing"]),
              missing_weight_seeded(f["missing"], MISSING)),
        _case("qwen3_5_moe_dp2_ep2_missing_weights_seeded", DP2_EP2, _seeded_logits(f["moe_missing"]),
              missing_weight_seeded(f["moe_missing"], MOE_MISSING)),
        _case("qwen3_tp4_tied_embeddings", TP4, _logits(f["tied"]), tied_embeddings(f["tied"])),
        _case("qwen3_5_moe_export_round_trip", DP2_TP2, _logits(f["moe"]), export_round_trip(f["moe"])),
        _case("bad_missing_tensor", DP2_TP2, None, _bad(f["missing"], init_missing=False),
              error="hypershard: from_pretrained: the checkpoint lacks 2 tensor(s) of the model: "
                    "['model.layers.0.self_attn.q_proj.weight', 'model.layers.1.mlp.up_proj.weight']"),
        _case("bad_partial_experts", DP2_EP2, None, _bad(f["moe_partial"]),
              error="holds 15 of the 16 per-expert tensors that make 'model.layers.0.mlp.experts.gate_up_proj' "
                    "but lacks ['model.layers.0.mlp.experts.3.up_proj.weight']"),
        _case("bad_shape", DP2_TP2, None, _bad(f["shape"]),
              error="checkpoint tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 32] but the model's "
                    "'model.layers.0.mlp.gate_proj.weight' has [48, 32]"),
        _case("bad_plan_cannot_shard", EP4, None, _bad(f["moe6"]),
              error="cannot shard 6 experts evenly over the 4 expert-parallel ranks"),
    ]


def test_from_pretrained_on_every_mesh_kind(folders):
    assert_all_passed(run_cases(cases(folders), backend="hypershard", timeout=900))


# ---------------------------------------------------------------------------------- peak RSS

# A Qwen3 of 22.0 M float32 parameters (88 MB): large enough that one rank holding the whole model
# (88 MB) is far outside the bound below (model / 4 = 22 MB + slice + overhead).
BIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, head_dim=64)
STAGING = 4 << 20
# The fixed overhead: what a load allocates besides the shards, one reading slice and the init
# staging -- the meta model's module and parameter objects, the DTensor wrappers and Layouts, the
# parsed headers, fully_shard's C++ group bookkeeping (a few hundred KB together at this size),
# page-table and allocator rounding (every local is its own page-aligned mmap above glibc's 128 KiB
# threshold), and mapped file pages the kernel maps around a slice (fault-around, 64 KiB; the
# reader drops 1 MiB around each slice). Measured 2.1 MB at most over 8 ranks (docs/loading.md);
# 8 MiB leaves room for allocator noise, while a loader that held the embedding whole at any time
# (16.8 MB, 12.6 MB more than its quarter) or the model whole (88 MB) fails the bound.
FIXED_OVERHEAD = 8 << 20

_WRITER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file, save_file
    from hypershard.testing.models import tiny_config, tiny_model
    model = tiny_model(tiny_config("qwen3", **{config}), seed=1)
    model.save_pretrained(sys.argv[1])
    model.save_pretrained(sys.argv[2])  # then without one MLP weight (3.1 MB), initialised at load
    path = sys.argv[2] + "/model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={{"format": "pt"}})
""")


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def measured_load(folder, out_dir, tag="", **options):
    def run(_dummy):
        import ctypes

        import torch.distributed as dist

        import hypershard as hs

        mesh = current_mesh()
        hs.from_pretrained(folder, mesh, **options)  # warm-up: imports, the model class, caches
        ctypes.CDLL("libc.so.6").malloc_trim(0)      # freed heap back to the OS: new memory shows
        before = _kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                             # VmHWM := VmRSS now
        model = hs.from_pretrained(folder, mesh, staging_bytes=STAGING, **options)
        peak = _kib("VmHWM") - before
        report = model.hs_load_report
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        bound = report.local_bytes + report.largest_slice + report.largest_init_staging + FIXED_OVERHEAD
        record = {"rank": dist.get_rank(), "peak_rss_increase": peak, "local_bytes": report.local_bytes,
                  "model_bytes": total, "largest_slice": report.largest_slice,
                  "init_staging": report.largest_init_staging, "bound": bound}
        with open(f"{out_dir}/rss_{options.get('fully_shard', False)}{tag}_{dist.get_rank()}.json", "w") as f:
            json.dump(record, f)
        assert peak <= bound, record
        return torch.zeros(1)
    return run


def test_peak_rss_within_the_bound(tmp_path):
    folder = tmp_path / "big"
    # Written by another process: this one (the ranks' parent) never holds the model.
    missing = tmp_path / "big_missing"
    subprocess.run([sys.executable, "-c", _WRITER.format(config=BIG), str(folder), str(missing)], check=True,
                   timeout=300)
    zeros = lambda _dummy: torch.zeros(1)  # noqa: E731
    result = run_cases([
        _case("rss_dp4_fully_shard", DP4, zeros, measured_load(folder, tmp_path, fully_shard=True)),
        _case("rss_tp4", TP4, zeros, measured_load(folder, tmp_path)),
        _case("rss_dp4_fully_shard_missing_weight", DP4, zeros,
              measured_load(missing, tmp_path, fully_shard=True, seed=1, tag="missing")),
    ], backend="hypershard", timeout=600)
    for path in sorted(tmp_path.glob("rss_*.json")):
        print(path.name, json.loads(path.read_text()))
    assert_all_passed(result)
    for path in tmp_path.glob("rss_True_*.json"):
        record = json.loads(path.read_text())
        # fully sharded on 4 ranks: the shards are a quarter of the model (uneven chunks aside)
        assert record["local_bytes"] <= record["model_bytes"] / 4 + (1 << 16), record
