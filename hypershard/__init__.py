"""hypershard: a C++ distributed tensor (DTensor) engine behind PyTorch's dispatcher.

``DTensor``, ``DeviceMesh``, ``init_device_mesh`` and ``distribute_tensor`` put tensors on a mesh;
every op on them runs hypershard's C++ operator flow (``hypershard._C``); ``hypershard.parallel``
parallelizes a model. The layout core is exposed too: meshes, layouts and their three notations
(torch-style placements, Hyper-Parallel alias tuples, MindSpore tensor_map), shard geometry and
the redistribution planner (``hypershard.layout`` has the small Python conveniences).
"""

import sys

import torch  # noqa: F401  (loads libtorch and its dependencies before _C)

from . import _C

if _C._torch_version != torch.__version__:
    raise ImportError(
        f"hypershard._C was built against torch {_C._torch_version}, but torch "
        f"{torch.__version__} is installed; rebuild it (make build, or "
        "pip install --no-build-isolation -e .)"
    )

from . import checkpoint  # noqa: E402  (also gives DTensors DCP's save/load protocol)
from ._C import (  # noqa: E402
    AliasLayout,
    Layout,
    LayoutError,
    Mesh,
    Placement,
    Placements,
    RedistributePlan,
    RedistributeStep,
    ReduceOp,
    Span,
    StepKind,
    chunk_span,
    numel,
    parse_alias,
    parse_reduce_op,
    plan_redistribute,
    reduce_op_name,
    step_kind_name,
    to_alias,
    to_placements,
    to_tensor_map,
)
from .compile import compile  # noqa: E402,A004  (hypershard.compile: the traced local program)
from .fsdp import FullyShardedModule, MixedPrecisionPolicy, fully_shard, mixed_precision, offload_optimizer  # noqa: E402
from .parallel import parallelize  # noqa: E402
from .parallel.recompute import recompute  # noqa: E402
from .pipelining import pipeline  # noqa: E402

# from_pretrained: hypershard.checkpoint.from_pretrained, and on a mesh with a pp axis the pipeline's
from .pipelining.loading import from_pretrained  # noqa: E402
from .tensor import layout, ops  # noqa: E402
from .tensor.axes import MESH_AXES, declare_replica_axis  # noqa: E402
from .tensor.dtensor import (  # noqa: E402
    DeviceMesh,
    DTensor,
    debug_checks,
    distribute_tensor,
    init_device_mesh,
    is_strict,
    layout_of,
    release_process_groups,
    set_debug_checks,
    set_strict,
    strict,
)
from .tensor.layout import (  # noqa: E402
    alias,
    from_alias,
    from_placements,
    from_tensor_map,
    make_layout,
    mesh,
    placement,
    placements,
)
from .tensor.local_map import DFunction, local_map  # noqa: E402
from .tensor.placement_types import Partial, Replicate, Shard  # noqa: E402
from .tensor.rules import register_rule  # noqa: E402
from .tensor.traced import TracedDTensor  # noqa: E402

# `import hypershard.ops` and `import hypershard.layout` keep working: both are public modules (the
# fused ops, the layout conveniences) that now live in the DTensor core, hypershard/tensor/.
sys.modules[__name__ + ".ops"] = ops
sys.modules[__name__ + ".layout"] = layout

LayoutError.__module__ = __name__  # shown as hypershard.LayoutError in tracebacks

__version__ = "0.1.0"

__all__ = [
    "AliasLayout",
    "DTensor",
    "FullyShardedModule",
    "MixedPrecisionPolicy",
    "DeviceMesh",
    "DFunction",
    "MESH_AXES",
    "Partial",
    "Replicate",
    "Shard",
    "debug_checks",
    "declare_replica_axis",
    "distribute_tensor",
    "set_debug_checks",
    "init_device_mesh",
    "is_strict",
    "release_process_groups",
    "set_strict",
    "strict",
    "Layout",
    "LayoutError",
    "Mesh",
    "Placement",
    "Placements",
    "RedistributePlan",
    "RedistributeStep",
    "ReduceOp",
    "Span",
    "StepKind",
    "TracedDTensor",
    "alias",
    "checkpoint",
    "chunk_span",
    "compile",
    "from_alias",
    "from_placements",
    "from_pretrained",
    "from_tensor_map",
    "fully_shard",
    "layout",
    "layout_of",
    "local_map",
    "make_layout",
    "mesh",
    "mixed_precision",
    "numel",
    "offload_optimizer",
    "ops",
    "parse_alias",
    "parallelize",
    "pipeline",
    "parse_reduce_op",
    "placement",
    "placements",
    "plan_redistribute",
    "recompute",
    "register_rule",
    "reduce_op_name",
    "step_kind_name",
    "to_alias",
    "to_placements",
    "to_tensor_map",
    "__version__",
]
