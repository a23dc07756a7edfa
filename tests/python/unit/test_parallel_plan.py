"""UT: parallelize()'s plan-style table (hypershard/parallel/), without processes.

Models are parallelized on a mesh without process groups (hypershard.testing.planning.PlanningMesh,
seen from one rank: distributing a parameter is a local slice, no collective), and the parameter
layouts, local shards and module hooks are checked for the MoE and MLA styles of transformers' plans:

- packed_colwise: the packed [gate; up] output-features dim (dim -2: dim 1 of a 3-d experts weight,
  dim 0 of a Linear weight) is sharded over tp;
- rowwise on a 3-d experts weight: its input-features dim (dim -1) is sharded; the bias Replicate;
- moe_tp_experts: the experts module's own parameters keep their keys' layouts (others Replicate),
  its tensor inputs are made Replicate on tp and its Partial(sum) output reduced (hooks);
- mla_kv_a_proj: weight Replicate, output made Replicate on tp (hook); needs qk_rope_head_dim;
- grouped_gemm (expert parallelism, an "ep" axis): the experts dim is sharded, evenly; the experts
  module runs this rank's experts on local tensors (hooks) before moe_tp_experts reduces its output.

A plan entry that cannot be honoured (an unknown style, an MLA projection without the config's
qk_rope_head_dim, an odd packed dim, experts not divisible by the ep ranks) raises a ValueError naming
the module and the style before any parameter is distributed.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import hypershard as hs
from hypershard.parallel import STYLES, parallelize, tp_plan_of
from hypershard.testing.planning import PlanningMesh

E, H, I = 4, 8, 6  # experts, hidden, intermediate (packed gate_up: 2 * I = 12 rows)


class Experts(nn.Module):
    def __init__(self, intermediate=I):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * intermediate, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, intermediate))
        self.extra_scale = nn.Parameter(torch.randn(E, H))   # no key of its own: Replicate

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class Block(nn.Module):
    def __init__(self, intermediate=I):
        super().__init__()
        self.experts = Experts(intermediate)
        self.kv_a_proj_with_mqa = nn.Linear(H, 12, bias=False)
        self.up = nn.Linear(H, 2 * I, bias=True)
        self.down = nn.Linear(I, H, bias=True)


class Model(nn.Module):
    def __init__(self, intermediate=I, rope=4):
        super().__init__()
        self.layers = nn.ModuleList([Block(intermediate) for _ in range(2)])
        self.config = types.SimpleNamespace() if rope is None else types.SimpleNamespace(qk_rope_head_dim=rope)


PLAN = {
    "layers.*.experts.gate_up_proj": "packed_colwise",
    "layers.*.experts.down_proj": "rowwise",
    "layers.*.experts": "moe_tp_experts",
    "layers.*.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.up": "packed_colwise",
    "layers.*.down": "rowwise",
}


def dim_axes(p):
    return [list(axes) for axes in hs.layout_of(p).dim_axes]


def full_params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("rank", [0, 1])
def test_moe_and_mla_styles_lay_out_parameters_like_transformers(rank):
    mesh = PlanningMesh({"dp": 2, "tp": 2}, rank=rank)
    torch.manual_seed(0)
    model = Model()
    before = full_params(model)
    parallelize(model, mesh.device_mesh, PLAN)
    tp = 1
    coordinate = mesh.device_mesh.coordinate(tp)
    expected = {  # parameter -> (the dim sharded over tp, or None for Replicate)
        "experts.gate_up_proj": 1, "experts.down_proj": 2, "experts.extra_scale": None,
        "kv_a_proj_with_mqa.weight": None, "up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None,
    }
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and hs._C.is_dtensor(p), name
        dim = expected[name.split(".", 2)[2]]
        want = [[] for _ in range(p.dim())]
        if dim is not None:
            want[dim] = [tp]
        assert dim_axes(p) == want, (name, dim_axes(p))
        assert not hs.layout_of(p).is_partial(0) and not hs.layout_of(p).is_partial(tp), name
        local = hs._C.local_of(p)
        piece = before[name] if dim is None else before[name].chunk(2, dim)[coordinate]
        assert torch.equal(local, piece), name
    experts, kv = model.layers[0].experts, model.layers[0].kv_a_proj_with_mqa
    assert len(experts._forward_pre_hooks) == 1 and len(experts._forward_hooks) == 1
    assert len(kv._forward_pre_hooks) == 0 and len(kv._forward_hooks) == 1
    assert len(model.layers[0].up._forward_hooks) == 0 and len(model.layers[0].down._forward_hooks) == 1


def test_hf_moe_plans_shard_the_experts_on_the_intermediate_dim():
    """The tiny Qwen3.5-MoE and DeepSeek-V3.2 of hypershard.testing.models with their own plans."""
    from hypershard.testing.models import tiny_config, tiny_model

    mesh = PlanningMesh({"dp": 2, "tp": 2})
    for model_type in ("qwen3_5_moe_text", "deepseek_v32"):
        model = parallelize(tiny_model(tiny_config(model_type)), mesh.device_mesh)
        plan = tp_plan_of(model)
        assert set(plan.values()) >= {"packed_colwise", "moe_tp_experts"}, plan
        experts = model.model.layers[1].mlp.experts
        assert dim_axes(experts.gate_up_proj) == [[], [1], []], model_type
        assert dim_axes(experts.down_proj) == [[], [], [1]], model_type
        assert len(experts._forward_pre_hooks) == 1 and len(experts._forward_hooks) == 1
        if model_type == "deepseek_v32":
            kv = model.model.layers[1].self_attn.kv_a_proj_with_mqa
            assert dim_axes(kv.weight) == [[], []] and len(kv._forward_hooks) == 1
        assert all(hs._C.is_dtensor(p) for p in model.parameters())


def test_no_tp_axis_leaves_every_parameter_replicate():
    model = parallelize(Model(), PlanningMesh({"dp": 2}).device_mesh, PLAN)
    for name, p in model.named_parameters():
        assert dim_axes(p) == [[] for _ in range(p.dim())], name
    assert len(model.layers[0].experts._forward_hooks) == 0


def test_grouped_gemm_shards_the_experts_dim_over_ep():
    mesh = PlanningMesh({"ep": 2})
    ep_plan = {"layers.*.experts.gate_up_proj": "grouped_gemm", "layers.*.experts.down_proj": "grouped_gemm",
               "layers.*.experts": "moe_tp_experts"}
    model = parallelize(Model(), mesh.device_mesh, ep_plan=ep_plan)
    experts = model.layers[0].experts
    assert dim_axes(experts.gate_up_proj) == [[0], [], []]
    assert dim_axes(experts.down_proj) == [[0], [], []]
    assert dim_axes(experts.extra_scale) == [[], []]
    # the local-experts hooks (this rank's experts on local tensors, output Partial over ep) run
    # before the moe_tp_experts reduction of that output
    post = list(experts._forward_hooks.values())
    assert len(post) == 2 and post[0].__qualname__.startswith("_local_experts")
    assert post[1].__qualname__.startswith("_replicate_on")
    assert any(h.__qualname__.startswith("_local_experts") for h in experts._forward_pre_hooks.values())
    with pytest.raises(ValueError, match=r"'layers\.0\.experts\.gate_up_proj'.*'grouped_gemm'.*4 experts.*3"):
        parallelize(Model(), PlanningMesh({"ep": 3}).device_mesh, ep_plan=ep_plan)


def test_tied_parameters_stay_one_parameter():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    parallelize(model, PlanningMesh({"tp": 2}).device_mesh, {"1": "colwise"})
    assert model[1].weight is model[0].weight and hs._C.is_dtensor(model[0].weight)
    assert dim_axes(model[0].weight) == [[], []]  # the first owner's (no style) layout


@pytest.mark.parametrize("plan,model_kwargs,pattern", [
    ({"layers.*.experts": "moe_tp_expert"}, {},
     r"module 'layers\.0\.experts': unknown plan style 'moe_tp_expert'; allowed: \[.*'moe_tp_experts'"),
    ({"layers.*.experts.gate_up_proj": "strided_colwise"}, {},
     r"module 'layers\.0\.experts\.gate_up_proj': unknown plan style 'strided_colwise'"),
    ({"layers.*.kv_a_proj_with_mqa": "mla_kv_a_proj"}, {"rope": None},
     r"module 'layers\.0\.kv_a_proj_with_mqa': plan style 'mla_kv_a_proj' needs the model config's "
     r"qk_rope_head_dim"),
    ({"layers.*.kv_a_proj_with_mqa": "mla_kv_a_proj"}, {"rope": 12},
     r"module 'layers\.0\.kv_a_proj_with_mqa': plan style 'mla_kv_a_proj' needs a linear projection"),
    ({"layers.*.experts.gate_up_proj": "packed_colwise"}, {"intermediate": 2.5},
     r"module 'layers\.0\.experts\.gate_up_proj': plan style 'packed_colwise' needs an even packed dim"),
])
def test_a_plan_entry_that_cannot_be_honoured_raises_before_distributing(plan, model_kwargs, pattern):
    kwargs = dict(model_kwargs)
    intermediate = kwargs.pop("intermediate", I)
    if isinstance(intermediate, float):  # an odd packed dim: 2 * 2.5 = 5 rows
        model = Model(**kwargs)
        model.layers[0].experts.gate_up_proj = nn.Parameter(torch.randn(E, 5, H))
    else:
        model = Model(intermediate, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        parallelize(model, PlanningMesh({"dp": 2, "tp": 2}).device_mesh, plan)
    assert not any(hs._C.is_dtensor(p) for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_every_style_of_transformers_moe_and_mla_plans_is_known():
    for style in ("colwise", "rowwise", "packed_colwise", "moe_tp_experts", "mla_kv_a_proj",
                  "replicated_with_grad_allreduce", "colwise_gather_output", "grouped_gemm", "ep_router"):
        assert style in STYLES, style


def test_tp_wider_than_kv_heads_keeps_kv_projections_whole():
    """2 KV heads on tp=4: k_proj / v_proj stay Replicate (every rank holds every KV head), q_proj and
    o_proj keep their colwise / rowwise sharding; with 4 KV heads k_proj is colwise as the plan says."""
    from hypershard.testing.models import tiny_config, tiny_model

    mesh = PlanningMesh({"tp": 4})
    for kv, k_spec in ((2, ["R"]), (4, ["S(0)"])):
        model = parallelize(tiny_model(tiny_config("qwen3", num_key_value_heads=kv)), mesh.device_mesh)
        attention = model.model.layers[0].self_attn
        specs = {name: [str(p)[0:1] if str(p).startswith("R") else f"S({p.dim})" for p in
                        getattr(attention, name).weight.placements] for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        assert specs == {"q_proj": ["S(0)"], "k_proj": k_spec, "v_proj": k_spec, "o_proj": ["S(1)"]}, (kv, specs)


def test_query_heads_not_divisible_by_tp_refused_up_front():
    from hypershard.testing.models import tiny_config, tiny_model

    model = tiny_model(tiny_config("qwen3", num_attention_heads=6, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match=r"config.num_attention_heads=6 is not divisible by the tensor-parallel "
                                         r"size 4"):
        parallelize(model, PlanningMesh({"tp": 4}).device_mesh)
    assert not any(hs._C.is_dtensor(p) for p in model.parameters())  # refused before distributing
