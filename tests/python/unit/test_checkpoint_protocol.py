"""UT (no processes): what hypershard DTensors answer to torch.distributed.checkpoint, and the
checkpoint folder bookkeeping of hypershard.checkpoint.

- __create_chunk_list__ / __create_write_items__ give this rank's chunk in GLOBAL offsets for
  every rank of even, uneven, empty and two-axis shardings (the chunks of all ranks tile the
  tensor); Replicate chunks are the whole tensor (DCP deduplicates them); Partial is refused.
- Plain tensors do not have the protocol (hasattr False), so DCP treats them as it does without
  hypershard.
- latest() returns the newest folder with a COMPLETE marker and ignores unfinished ones.
"""

import itertools
import json
import math

import pytest
import torch

import hypershard as hs  # noqa: F401  (installs the protocol)
from hypershard import checkpoint
from hypershard.testing.planning import PlanningMesh

CASES = [  # mesh, global shape, spec
    ({"tp": 4}, [8, 6], ["S(0)"]),
    ({"tp": 4}, [7, 5], ["S(0)"]),           # uneven: 2, 2, 2, 1
    ({"tp": 4}, [3, 5], ["S(0)"]),           # an empty shard
    ({"tp": 4}, [5, 6], ["S(1)"]),
    ({"dp": 2, "tp": 2}, [8, 6], ["S(0)", "S(1)"]),
    ({"dp": 2, "tp": 2}, [7, 6], ["S(0)", "S(0)"]),  # dim 0 over both axes
    ({"dp": 2, "tp": 2}, [9, 4], ["R", "S(0)"]),
    ({"dp": 2, "tp": 2}, [4, 4], ["R", "R"]),
]


def _chunks(shape_of_mesh, shape, spec):
    out = []
    for rank in range(math.prod(shape_of_mesh.values())):
        t = PlanningMesh(shape_of_mesh, rank).dtensor(shape, spec)
        (chunk,) = t.__create_chunk_list__()
        (item,) = t.__create_write_items__("w", t)
        assert item.index.fqn == "w" and item.index.offset == chunk.offsets
        assert item.tensor_data.chunk == chunk and item.tensor_data.size == torch.Size(shape)
        assert list(chunk.sizes) == list(hs._C.local_of(t).shape)
        out.append(chunk)
    return out


@pytest.mark.parametrize("mesh,shape,spec", CASES, ids=[f"{m}-{s}-{p}" for m, s, p in CASES])
def test_chunks_tile_the_global_tensor(mesh, shape, spec):
    chunks = _chunks(mesh, shape, spec)
    distinct = {(tuple(c.offsets), tuple(c.sizes)) for c in chunks}
    covered = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in distinct:
        covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    assert torch.equal(covered, torch.ones(shape, dtype=torch.int64)), (spec, distinct)


def test_uneven_offsets_are_global():
    offsets = [list(c.offsets) for c in _chunks({"tp": 4}, [7, 5], ["S(0)"])]
    assert offsets == [[0, 0], [2, 0], [4, 0], [6, 0]]
    offsets = [list(c.offsets) for c in _chunks({"dp": 2, "tp": 2}, [7, 6], ["S(0)", "S(0)"])]
    assert offsets == [[0, 0], [2, 0], [4, 0], [6, 0]]


def test_partial_is_refused():
    t = PlanningMesh({"tp": 2}).dtensor([4, 4], [hs.Partial()])
    with pytest.raises(RuntimeError, match="hypershard: checkpoint: w is Partial"):
        t.__create_write_items__("w", t)


def test_plain_tensors_do_not_have_the_protocol():
    plain = torch.ones(3)
    for name in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__"):
        assert not hasattr(plain, name)
        assert hasattr(PlanningMesh({"tp": 2}).dtensor([4], ["S(0)"]), name)


def _fake_checkpoint(root, step, complete):
    path = checkpoint.step_dir(root, step)
    path.mkdir(parents=True)
    if complete:
        (path / checkpoint.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    return path


def test_latest_ignores_unfinished_checkpoints(tmp_path):
    assert checkpoint.latest(tmp_path) is None and checkpoint.latest(tmp_path / "missing") is None
    for step, complete in itertools.product([1, 5, 12], [True]):
        _fake_checkpoint(tmp_path, step, complete)
    _fake_checkpoint(tmp_path, 20, False)  # a save that never finished
    (tmp_path / "step_notanumber").mkdir()
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 12)
    assert checkpoint.complete_checkpoints(tmp_path) == [checkpoint.step_dir(tmp_path, s) for s in (1, 5, 12)]


def test_load_refuses_a_folder_without_a_complete_checkpoint(tmp_path):
    path = _fake_checkpoint(tmp_path, 3, False)
    with pytest.raises(RuntimeError, match="is not a complete checkpoint"):
        checkpoint.load(path, torch.nn.Linear(2, 2))


def test_export_names_drop_tied_duplicates():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 3)
    model.head = torch.nn.Linear(3, 4, bias=False)
    model.head.weight = model.embed.weight
    model._tied_weights_keys = {"head.weight": "embed.weight"}
    assert checkpoint.api._export_names(model, model.state_dict()) == ["embed.weight"]


def test_resume_point_skips_partial_checkpoints_and_names_them(tmp_path):
    _fake_checkpoint(tmp_path, 2, True)
    _fake_checkpoint(tmp_path, 3, False)  # a folder without the marker (a save of an older hypershard)
    partial = checkpoint.partial_dir(checkpoint.step_dir(tmp_path, 4))
    partial.mkdir()  # a save that failed or was killed
    newest, skipped = checkpoint.resume_point(tmp_path)
    assert newest == checkpoint.step_dir(tmp_path, 2)
    assert skipped == [
        (checkpoint.step_dir(tmp_path, 3), "no COMPLETE marker: its save did not finish on every rank"),
        (partial, "a save that did not finish (its temporary folder; no COMPLETE marker)"),
    ]
    assert checkpoint.api._resolve(tmp_path) == newest  # a folder of checkpoints: the newest complete one
    for explicit in (checkpoint.step_dir(tmp_path, 3), partial):  # named explicitly: refused, with the reason
        with pytest.raises(RuntimeError, match="is not a complete checkpoint: .*the newest complete one next to it is"):
            checkpoint.api._resolve(explicit)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_00000004.partial", "step_00000002",
                                                          "step_00000003"]  # nothing deleted


def test_llamafactory_newest_complete_checkpoint(tmp_path):
    pytest.importorskip("llamafactory")  # the integration's module imports nothing of it at module level
    from hypershard.integrations.llamafactory import resume

    for step, marker in ((2, True), (4, False), (6, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if marker:
            resume.write_marker(folder, step, 2)
    (tmp_path / "checkpoint-6" / "trainer_state.json").write_text("{}")
    newest, skipped = resume.newest_complete(tmp_path)
    assert newest == tmp_path / "checkpoint-2"
    assert [(p.name, why) for p, why in skipped] == [
        ("checkpoint-4", "no COMPLETE marker: its save did not finish on every rank; it lacks complete "
                         "model/optimizer shards (hypershard/step_N/COMPLETE) and trainer_state.json"),
        ("checkpoint-6", "no COMPLETE marker: its save did not finish on every rank; it lacks complete "
                         "model/optimizer shards (hypershard/step_N/COMPLETE)"),
    ]
    assert resume.get_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")  # LlamaFactory's auto resume
    assert resume.resolve(True, tmp_path) == str(tmp_path / "checkpoint-2")  # resume_from_checkpoint: true
    with pytest.raises(Exception, match="checkpoint-6' is a partial checkpoint .*the newest next to it: .*checkpoint-2"):
        resume.resolve(str(tmp_path / "checkpoint-6"), tmp_path)  # named explicitly: refused
    assert resume.newest_complete(tmp_path / "missing") == (None, [])
