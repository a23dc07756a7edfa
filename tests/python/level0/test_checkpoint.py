"""Level0: sharded checkpoints through torch.distributed.checkpoint (DCP) on real meshes.

- Every pair of the meshes dp=2 x tp=2, tp=4 and dp=4 (4 ranks), tp=2 and dp=2 (2 ranks) and one
  rank without hypershard: a tiny Qwen3 with UNEVEN sizes (vocab 126, intermediate 62: shards of
  32/32/31/31 and 16/16/15/15 rows) trained 2 AdamW steps on the source mesh is saved with
  hypershard.checkpoint.save and loaded into a fresh model and optimizer on the target mesh;
  parameters and AdamW state (exp_avg, exp_avg_sq, step) equal the source's full_tensor() exactly
  (a load copies bytes, so no tolerance), and the optimizer state takes its parameter's layout.
- The raw DCP API (dcp.save/dcp.load, no hypershard.checkpoint) on a dict of DTensors: even,
  uneven, empty shards, one dim sharded over both axes, Replicate, a plain tensor and an int.
- Each rank writes only its shards: every saved tensor is stored as chunks that tile it exactly
  once (Replicate copies once), adding up to the model + optimizer bytes, not world x model.
- A save killed between the shards and the COMPLETE marker leaves only its temporary folder
  (.step_N.partial) and the previous checkpoint the latest; loading the killed folder by name is
  refused.
"""

import math
import os
from pathlib import Path

import pytest
import torch

from hypershard.launch import spawn_local_ranks

MESHES4 = {"dp2_tp2": ((2, 2), ("dp", "tp")), "tp4": ((4,), ("tp",)), "dp4": ((4,), ("dp",))}
MESHES2 = {"tp2": ((2,), ("tp",)), "dp2": ((2,), ("dp",))}
UNEVEN = dict(vocab_size=126, intermediate_size=62)
TIMEOUT = 420


def _model(mesh_spec, seed=0):
    """The tiny uneven Qwen3, parallelized on `mesh_spec` (None: plain, one device)."""
    from hypershard.testing.models import tiny_config, tiny_model

    model = tiny_model(tiny_config("qwen3", **UNEVEN), seed=seed)
    if mesh_spec is None:
        return model
    import hypershard as hs
    from hypershard.parallel import parallelize

    return parallelize(model, hs.init_device_mesh("cpu", *mesh_spec))


def _train(model, steps=2):
    from hypershard.testing.models import make_batches

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for ids, labels in make_batches(UNEVEN["vocab_size"], steps, batch=4, seq=8):
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    return optimizer


def _full(t):
    import hypershard as hs

    return t.full_tensor() if isinstance(t, hs.DTensor) else t.detach().clone()


def _snapshot(model, optimizer) -> dict:
    """Full values of every parameter and optimizer state, keyed by name."""
    from hypershard.checkpoint import optimizer_state_dict

    out = {f"param/{n}": _full(p) for n, p in model.named_parameters()}
    for name, state in optimizer_state_dict(model, optimizer)["state"].items():
        for key, value in state.items():
            out[f"optim/{name}/{key}"] = _full(value)
    return out


def _compare(expected: dict, model, optimizer) -> list:
    """Names whose loaded value differs, plus optimizer states whose layout is not their parameter's."""
    import hypershard as hs
    from hypershard.checkpoint import optimizer_state_dict

    got = _snapshot(model, optimizer)
    bad = [n for n in expected if n not in got or not torch.equal(expected[n], got[n])]
    params = dict(model.named_parameters())
    for name, state in optimizer_state_dict(model, optimizer)["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(params[name], hs.DTensor) and hs.layout_of(state[key]) != hs.layout_of(params[name]):
                bad.append(f"layout of optim/{name}/{key}")
    return bad


def _raw_dtensors(mesh_spec):
    """A dict of DTensors in assorted layouts (same global values on every mesh), a plain tensor and an int."""
    import hypershard as hs

    mesh = hs.init_device_mesh("cpu", *mesh_spec)
    g = torch.Generator().manual_seed(7)
    values = {"even": torch.randn(8, 6, generator=g), "uneven": torch.randn(7, 5, generator=g),
              "empty_shards": torch.randn(3, 2, generator=g), "vector": torch.randn(9, generator=g)}
    two_axes = len(mesh_spec[0]) == 2
    specs = {"even": ["S(1)", "S(0)"] if two_axes else ["S(0)"],
             "uneven": ["S(0)", "S(0)"] if two_axes else ["S(1)"],  # dim 0 over both axes: 7 rows in 4 pieces
             "empty_shards": ["R", "S(0)"] if two_axes else ["S(0)"],  # 3 rows on 4 ranks: one empty
             "vector": ["R", "R"] if two_axes else ["R"]}
    state = {name: hs.distribute_tensor(values[name], mesh, specs[name]) for name in values}
    state["plain"] = torch.arange(5.0)
    state["count"] = 17
    return state, values


def _save_sources(rank, world, root, meshes):
    """Saves one checkpoint per source mesh, with the source's full values for the targets."""
    import torch.distributed.checkpoint as dcp

    from hypershard import checkpoint

    for name, spec in meshes.items():
        model = _model(spec)
        optimizer = _train(model)
        expected = _snapshot(model, optimizer)
        checkpoint.save(Path(root, name), model, optimizer, step=2, extra={"source": name})
        raw, _ = _raw_dtensors(spec)
        dcp.save(raw, checkpoint_id=str(Path(root, f"raw_{name}")))
        if rank == 0:
            torch.save(expected, Path(root, f"expected_{name}.pt"))
    torch.distributed.barrier()
    return "saved"


def _load_targets(rank, world, root, sources, targets):
    """Loads every source checkpoint into every target mesh; returns the mismatches."""
    import torch.distributed.checkpoint as dcp

    import hypershard as hs
    from hypershard import checkpoint

    failures = []
    for target, spec in targets.items():
        for source in sources:
            model = _model(spec, seed=1)  # other initial values than the source
            optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
            extra = checkpoint.load(Path(root, source), model, optimizer)
            expected = torch.load(Path(root, f"expected_{source}.pt"))
            bad = _compare(expected, model, optimizer)
            if extra != {"source": source}:
                bad.append(f"extra {extra}")
            if optimizer.param_groups[0]["lr"] != 1e-2:
                bad.append(f"lr {optimizer.param_groups[0]['lr']}")  # the saved hyper-parameters
            if bad:
                failures.append(f"{source} -> {target}: {bad[:4]}")
            if spec is None:
                continue
            raw, values = _raw_dtensors(spec)
            for name in values:  # other values to load into
                with torch.no_grad():
                    hs._C.local_of(raw[name]).fill_(-1.0)
            raw["plain"] = torch.zeros(5)
            raw["count"] = 0
            dcp.load(raw, checkpoint_id=str(Path(root, f"raw_{source}")))
            bad = [n for n in values if not torch.equal(raw[n].full_tensor(), values[n])]
            if not torch.equal(raw["plain"], torch.arange(5.0)) or raw["count"] != 17:
                bad.append("plain/count")
            if bad:
                failures.append(f"raw {source} -> {target}: {bad}")
    return failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    spawn_local_ranks(_save_sources, 4, str(root), MESHES4, timeout=TIMEOUT)
    spawn_local_ranks(_save_sources, 2, str(root), MESHES2, timeout=TIMEOUT)
    return root


def test_reshard_between_4_rank_meshes(saved):
    failures = spawn_local_ranks(_load_targets, 4, str(saved), list(MESHES4) + list(MESHES2), MESHES4,
                                 timeout=TIMEOUT)
    assert failures == [[]] * 4, failures


def test_reshard_onto_2_ranks_and_one_plain_device(saved):
    failures = spawn_local_ranks(_load_targets, 2, str(saved), list(MESHES4) + list(MESHES2), MESHES2,
                                 timeout=TIMEOUT)
    assert failures == [[]] * 2, failures
    failures = spawn_local_ranks(_load_targets, 1, str(saved), list(MESHES4), {"one_plain_device": None},
                                 timeout=TIMEOUT)
    assert failures == [[]], failures


def _overlap(a, b) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def test_each_rank_writes_only_its_shards(saved):
    """Every saved tensor is stored as chunks that tile it exactly once (Replicate copies deduplicated,
    no gathered tensor), the chunk bytes add up to the model + optimizer state bytes, and the data files
    hold nothing else than those chunks (each with torch.save's framing, ~1.5 KB per chunk)."""
    import torch.distributed.checkpoint as dcp

    from hypershard.checkpoint import latest

    for name in list(MESHES4) + list(MESHES2):
        path = latest(saved / name)
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        chunk_bytes = 0
        for fqn, md in metadata.state_dict_metadata.items():
            if not hasattr(md, "chunks"):
                continue
            numels = [math.prod(c.sizes) for c in md.chunks]
            assert sum(numels) == math.prod(md.size), f"{name}: {fqn} chunks {md.chunks} do not tile {md.size}"
            assert not any(_overlap(a, b) for i, a in enumerate(md.chunks) for b in md.chunks[i + 1:]
                           if math.prod(a.sizes) and math.prod(b.sizes)), f"{name}: {fqn} overlapping chunks"
            chunk_bytes += sum(numels) * md.properties.dtype.itemsize
        expected = torch.load(saved / f"expected_{name}.pt")
        assert chunk_bytes == sum(t.numel() * t.element_size() for t in expected.values()), name
        files = {p.name: p.stat().st_size for p in path.glob("*.distcp")}
        assert sum(files.values()) == sum(info.length for info in metadata.storage_data.values()), name
        world = math.prod((MESHES4 | MESHES2)[name][0])
        assert len(files) == world, f"{name}: {sorted(files)}"


def _killed_save(rank, world, root):
    import torch.distributed.checkpoint as dcp

    from hypershard import checkpoint

    model = _model(MESHES2["dp2"])
    optimizer = _train(model, steps=1)
    checkpoint.save(root, model, optimizer, step=1)
    real_save = dcp.save

    def save_then_die(*args, **kwargs):
        result = real_save(*args, **kwargs)
        if rank == 1:
            os._exit(3)  # killed after writing its shards, before the COMPLETE marker
        return result

    dcp.save = save_then_die
    checkpoint.save(root, model, optimizer, step=2)
    return "not reached"


def test_killed_save_leaves_no_complete_checkpoint(tmp_path):
    from hypershard.checkpoint import latest, load

    with pytest.raises(Exception, match="exit"):
        spawn_local_ranks(_killed_save, 2, str(tmp_path), timeout=TIMEOUT, pg_timeout=30)
    assert (tmp_path / ".step_00000002.partial").is_dir(), "the killed save never started"
    assert not (tmp_path / "step_00000002").exists()  # written under a temporary name until complete
    assert latest(tmp_path) == tmp_path / "step_00000001"
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        load(tmp_path / ".step_00000002.partial", _model(None))


def _export(rank, world, root, model_type, mesh_spec):
    import hypershard as hs
    from hypershard import checkpoint
    from hypershard.parallel import parallelize
    from hypershard.testing.models import tiny_config, tiny_model

    overrides = UNEVEN if model_type == "qwen3" else {}
    model = parallelize(tiny_model(tiny_config(model_type, **overrides)), hs.init_device_mesh("cpu", *mesh_spec))
    expected = {name: _full(t) for name, t in model.state_dict().items()}
    checkpoint.export_hf(model, Path(root, model_type), max_shard_bytes=16_000)  # several files
    if rank == 0:
        torch.save(expected, Path(root, f"expected_{model_type}.pt"))
    return "exported"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_moe_text"])
def test_export_hf_loads_with_from_pretrained(tmp_path, model_type):
    """export_hf from dp=2 x tp=2 shards writes a save_pretrained folder (several safetensors files,
    their index, config.json; MoE experts split back into transformers' checkpoint format) that
    from_pretrained loads on one device with the distributed model's exact values."""
    import json

    from transformers import AutoModelForCausalLM

    spawn_local_ranks(_export, 4, str(tmp_path), model_type, MESHES4["dp2_tp2"], timeout=TIMEOUT)
    folder = tmp_path / model_type
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert (folder / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(folder).float().state_dict()
    expected = torch.load(tmp_path / f"expected_{model_type}.pt")
    assert sorted(loaded) == sorted(expected)
    assert [n for n in expected if not torch.equal(loaded[n], expected[n])] == []
