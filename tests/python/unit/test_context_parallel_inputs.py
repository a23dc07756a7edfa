"""UT: what parallelize does to a forward's inputs on a context-parallel mesh before sharding them
(hypershard.parallel._head_tail_inputs, docs/context_parallel.md): labels shifted over the whole
natural-order sequence, then input ids, position ids and labels put in head-tail order; refusals
for a length 2 x cp does not divide, a padding mask and an unknown cp_algorithm (parallelize's and the mesh's). No processes."""

import pytest
import torch

from hypershard.context_parallel import from_head_tail, head_tail_order, to_head_tail
from hypershard.parallel import CP_ALGORITHMS, _head_tail_inputs, parallelize


def test_inputs_in_head_tail_order_with_global_shift():
    ids = torch.arange(8).reshape(1, 8) + 10
    labels = ids.clone()
    labels[0, 5] = -100
    out = _head_tail_inputs({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(1, 8)}, chunks=4)
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    assert out["input_ids"].tolist() == [[10 + p for p in order]]
    assert out["position_ids"].tolist() == [order]
    # position p's target is token p + 1 (-100 after the last, and where labels had -100)
    natural_targets = [11, 12, 13, 14, -100, 16, 17, -100]
    assert out["shift_labels"].tolist() == [[natural_targets[p] for p in order]]
    assert torch.equal(out["labels"], out["shift_labels"])
    assert "attention_mask" not in out  # all ones: masks nothing


def test_round_trip():
    x = torch.randn(2, 12, 3)
    assert torch.equal(from_head_tail(to_head_tail(x, 1, 6), 1, 6), x)
    assert sorted(head_tail_order(12, 6).tolist()) == list(range(12))


def test_refusals():
    with pytest.raises(ValueError, match="cannot be stored in head-tail order of 4 chunks"):
        _head_tail_inputs({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, chunks=4)
    mask = torch.ones(1, 8)
    mask[0, 7] = 0
    with pytest.raises(ValueError, match="padding attention_mask"):
        _head_tail_inputs({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": mask}, chunks=4)
    with pytest.raises(ValueError, match="head-tail chunks"):
        head_tail_order(6, 4)
    assert CP_ALGORITHMS == ("all_gather_kv", "ulysses", "ring")

    class Mesh:
        mesh_dim_names = ("cp",)
        shape = (2,)
    with pytest.raises(ValueError, match="cp_algorithm 'pass_q' is not implemented"):
        parallelize(torch.nn.Linear(2, 2), Mesh(), cp_algorithm="pass_q")


def test_mesh_cp_algorithm():
    """The DeviceMesh property the attention expand reads per call: every name parallelize accepts
    round-trips, an unknown one is refused with the allowed names."""
    from hypershard.testing.planning import PlanningMesh

    mesh = PlanningMesh({"cp": 2}).device_mesh
    assert mesh.cp_algorithm == "all_gather_kv"
    for name in CP_ALGORITHMS:
        mesh.cp_algorithm = name
        assert mesh.cp_algorithm == name
    with pytest.raises(ValueError, match="cp_algorithm 'pass_q' is not known; allowed: all_gather_kv, ulysses, ring"):
        mesh.cp_algorithm = "pass_q"
