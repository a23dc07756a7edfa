"""UT: parallelize()'s plan styles as objects, its attention layouts, and local experts that leave
the experts module untouched (hypershard/parallel/), without processes.

- Each plan style is one `Style` object: the dim it shards of a Linear / Embedding / 3-d experts
  parameter, whether its module's inputs / output are made Replicate, and its own checks (with the
  refusal text).
- Attention heads on tp are laid out before anything is distributed: heads sharded where tp divides
  the KV heads, k_proj/v_proj replicated where tp is a multiple of them (each rank's query heads in
  one KV group), the whole attention replicated otherwise (6 query / 3 KV heads on tp=2), refused
  where tp does not divide the query heads or the query heads do not group over the KV heads.
- Expert parallelism runs the experts' forward on a view with the local weights: the module itself is
  never altered, so a forward that raises inside the experts leaves it exactly as it was.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import hypershard as hs
from hypershard.parallel import STYLES, parallelize, style
from hypershard.parallel.attention import ATTENTION_REPLICATED, HEADS_SHARDED, KV_REPLICATED, _attention_layout
from hypershard.testing.planning import PlanningMesh

# ---------------------------------------------------------------------------------- style objects

LINEAR, EMBEDDING = nn.Linear(6, 4), nn.Embedding(10, 4)
EXPERTS_WEIGHT = torch.zeros(8, 12, 6)  # [experts, out, in]

# style -> dims sharded for (Linear weight, Linear bias, Embedding weight, experts weight); None: Replicate
DIMS = {
    "colwise": (0, 0, 1, 1), "colwise_gather_output": (0, 0, 1, 1), "packed_colwise": (0, 0, 1, 1),
    "rowwise": (1, None, 0, 2), "rowwise_split_input": (1, None, 0, 2),
    "embedding_rowwise": (0, None, 0, None), "vocab": (0, None, 0, None),
    "embedding_colwise": (1, None, 1, None),
    "grouped_gemm": (0, None, 0, 0),
}


@pytest.mark.parametrize("name", STYLES)
def test_each_style_knows_the_dims_it_shards(name):
    s = style(name)
    got = (s.param_dim(LINEAR, "weight", LINEAR.weight), s.param_dim(LINEAR, "bias", LINEAR.bias),
           s.param_dim(EMBEDDING, "weight", EMBEDDING.weight),
           s.param_dim(nn.Module(), "gate_up_proj", EXPERTS_WEIGHT))
    assert got == DIMS.get(name, (None, None, None, None)), (name, got)


def test_which_styles_make_module_inputs_and_outputs_replicate():
    outputs = {n for n in STYLES if style(n).replicate_output}
    inputs = {n for n in STYLES if style(n).replicate_inputs}
    assert outputs == {"colwise_gather_output", "rowwise", "rowwise_split_input", "embedding_rowwise", "vocab",
                       "embedding_colwise", "moe_tp_experts", "mla_kv_a_proj"}
    assert inputs == {"moe_tp_experts"}


def test_an_unknown_style_name_has_no_object():
    with pytest.raises(KeyError):
        style("strided_colwise")


def test_style_checks_name_the_module_and_the_reason():
    with pytest.raises(ValueError, match=r"module 'e\.gate_up_proj': plan style 'packed_colwise' needs an even "
                                         r"packed dim \(\[gate; up\] halves\); got size 5 in dim 1"):
        style("packed_colwise").check_param("e.gate_up_proj", torch.zeros(4, 5, 3), 1, 2)
    style("packed_colwise").check_param("e.gate_up_proj", torch.zeros(4, 6, 3), 1, 2)
    style("packed_colwise").check_param("e.gate_up_proj", torch.zeros(4, 5, 3), None, 2)  # not sharded: fine
    with pytest.raises(ValueError, match=r"module 'e\.down_proj': plan style 'grouped_gemm' cannot shard 4 experts "
                                         r"evenly over the 3 expert-parallel ranks"):
        style("grouped_gemm").check_param("e.down_proj", torch.zeros(4, 2, 2), 0, 3)
    model = types.SimpleNamespace(config=types.SimpleNamespace())
    with pytest.raises(ValueError, match=r"module 'kv': plan style 'mla_kv_a_proj' needs the model config's "
                                         r"qk_rope_head_dim"):
        style("mla_kv_a_proj").check_module(model, "kv", nn.Linear(4, 12))
    model.config.qk_rope_head_dim = 4
    style("mla_kv_a_proj").check_module(model, "kv", nn.Linear(4, 12))
    for name in STYLES:  # the other styles take any module and parameter
        if name not in ("packed_colwise", "grouped_gemm", "mla_kv_a_proj"):
            style(name).check_module(model, "m", LINEAR)
            style(name).check_param("m.weight", torch.zeros(3, 5), 0, 2)


# ------------------------------------------------------------------------------ attention layouts

def _model(heads, kv):
    return types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv))


@pytest.mark.parametrize("heads,kv,tp,layout", [
    (4, 4, 2, HEADS_SHARDED), (8, 4, 4, HEADS_SHARDED), (6, 3, 3, HEADS_SHARDED), (4, 2, 1, HEADS_SHARDED),
    (4, 2, 4, KV_REPLICATED), (16, 4, 8, KV_REPLICATED), (12, 3, 6, KV_REPLICATED), (8, 1, 8, KV_REPLICATED),
    (6, 3, 2, ATTENTION_REPLICATED), (12, 4, 6, ATTENTION_REPLICATED), (24, 6, 4, ATTENTION_REPLICATED),
])
def test_attention_layout_follows_the_kv_groups(heads, kv, tp, layout):
    assert _attention_layout(_model(heads, kv), tp) == layout
    if layout == KV_REPLICATED:  # every rank's block of query heads lies in one KV group
        group, local = heads // kv, heads // tp
        assert all(r * local // group == (r * local + local - 1) // group for r in range(tp))


@pytest.mark.parametrize("heads,kv,tp,pattern", [
    (6, 3, 4, r"config.num_attention_heads=6 is not divisible by the tensor-parallel size 4; allowed: a tp size "
              r"that divides it"),
    (6, 4, 2, r"config.num_attention_heads=6 is not a multiple of config.num_key_value_heads=4: the query heads "
              r"cannot be grouped over the key/value heads, so no tensor-parallel layout of the attention exists"),
])
def test_no_attention_layout_is_refused_with_the_reason(heads, kv, tp, pattern):
    with pytest.raises(ValueError, match=pattern):
        _attention_layout(_model(heads, kv), tp)


def _specs(module):
    return {name: [str(p) for p in param.placements] for name, param in module.named_parameters()}


def test_qwen3_with_3_kv_heads_on_tp2_replicates_its_attention_and_shards_the_rest():
    """6 query / 3 KV heads on dp2 x tp2: no layout with sharded query heads runs (rank 0's query
    heads read KV heads 0-1, rank 1's 1-2), so every attention entry becomes replicate -- decided in
    parallelize, with a warning -- while the MLP keeps its plan."""
    from hypershard.testing.models import tiny_config, tiny_model

    model = tiny_model(tiny_config("qwen3", num_attention_heads=6, num_key_value_heads=3))
    with pytest.warns(UserWarning, match=r"3 key/value heads \(grouped under 6 query heads\) cannot be laid out "
                                         r"with the query heads sharded over tp=2.*'model\.layers\.\*\.self_attn\.'"):
        parallelize(model, PlanningMesh({"dp": 2, "tp": 2}).device_mesh)
    layer = model.model.layers[0]
    replicate = ["Replicate()", "Replicate()"]
    assert set(map(tuple, _specs(layer.self_attn).values())) == {tuple(replicate)}, _specs(layer.self_attn)
    assert not layer.self_attn.o_proj._forward_hooks  # nothing to reduce: its output is whole already
    assert _specs(layer.mlp) == {"gate_proj.weight": ["Replicate()", "Shard(dim=0)"],
                                 "up_proj.weight": ["Replicate()", "Shard(dim=0)"],
                                 "down_proj.weight": ["Replicate()", "Shard(dim=1)"]}, _specs(layer.mlp)


def test_refused_attention_distributes_nothing():
    from hypershard.testing.models import tiny_config, tiny_model

    model = tiny_model(tiny_config("qwen3", num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"num_attention_heads=6 is not divisible by the tensor-parallel size 4"):
        parallelize(model, PlanningMesh({"tp": 4}).device_mesh)
    assert not any(hs._C.is_dtensor(p) for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# --------------------------------------------------------------------------------- local experts

E, H, I = 4, 6, 3


class RaisingExperts(nn.Module):
    """Records what its forward sees; raises when told to."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I))
        self.raise_inside = True
        self.seen = []

    def forward(self, hidden_states, top_k_index, top_k_weights):
        self.seen.append(dict(num_experts=self.num_experts, gate_up=self.gate_up_proj,
                              expert_parallel=getattr(self, "_is_expert_parallel", None), index=top_k_index))
        if self.raise_inside:
            raise RuntimeError("boom inside the experts")
        return hidden_states


class MoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = RaisingExperts()


def _snapshot(module):
    """The module's attributes and its parameters dict's entries (compared by identity)."""
    return dict(module.__dict__), dict(module._parameters)


def _same(before, after):
    return after.keys() == before.keys() and all(after[k] is v for k, v in before.items())


def test_a_forward_raising_inside_the_experts_leaves_the_module_as_it_was():
    mesh = PlanningMesh({"ep": 2}, rank=1)
    ep_plan = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm",
               "experts": "moe_tp_experts"}
    block = parallelize(MoeBlock(), mesh.device_mesh, ep_plan=ep_plan, shard_inputs=False)
    experts = block.experts
    attributes, parameters = _snapshot(experts)
    tokens, top_k = 5, 2
    hidden = hs.distribute_tensor(torch.randn(tokens, H), mesh.device_mesh, [hs.Replicate()])
    index = hs.distribute_tensor(torch.tensor([[0, 3], [1, 2], [2, 3], [0, 1], [3, 2]]), mesh.device_mesh,
                                 [hs.Replicate()])
    weights = hs.distribute_tensor(torch.rand(tokens, top_k), mesh.device_mesh, [hs.Replicate()])

    with pytest.raises(RuntimeError, match="boom inside the experts"):
        experts(hidden, index, weights)
    attributes_after, parameters_after = _snapshot(experts)
    assert _same(attributes, attributes_after), [k for k in attributes_after.keys() | attributes.keys()
                                                 if attributes_after.get(k) is not attributes.get(k)]
    assert _same(parameters, parameters_after)
    assert "_is_expert_parallel" not in attributes_after
    assert experts.num_experts == E and hs._C.is_dtensor(experts.gate_up_proj)
    # what the forward saw: rank 1's two experts, local weights, the routing in local ids (2: another rank's)
    (call,) = experts.seen
    assert call["num_experts"] == 2 and call["expert_parallel"] is True
    assert not hs._C.is_dtensor(call["gate_up"]) and list(call["gate_up"].shape) == [2, 2 * I, H]
    assert call["index"].tolist() == [[2, 1], [2, 0], [0, 1], [2, 2], [1, 0]]

    # a call the hooks leave alone (plain tensors) runs on the module itself
    experts.seen.clear()
    experts.raise_inside = False
    out = experts(torch.randn(tokens, H), torch.zeros(tokens, top_k, dtype=torch.long), torch.rand(tokens, top_k))
    assert out.shape == (tokens, H) and experts.seen[0]["num_experts"] == E
    assert hs._C.is_dtensor(experts.seen[0]["gate_up"])
