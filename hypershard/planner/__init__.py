"""The planner: one training step of a true-size model, simulated as one rank of a large mesh.

`python -m hypershard.plan` is the command line (hypershard/planner/cli.py); this package holds its parts:

- `world`: a simulated mesh (c10d process groups without a backend) whose collectives on meta
  tensors are recorded per mesh axis instead of sent;
- `memory`: live-bytes accounting of meta tensors (which allocate nothing) by storage lifetime;
- `step`: building a model (meta or real), sharding it, and running forward + backward + AdamW,
  shared by the planner and by the 4-rank measurement that validates it;
- `run`: the planned step (`plan_step`) and the measured one (`measure_rank`);
- `validate`: the two compared (``python -m hypershard.planner.validate``);
- `pipeline`: the pp axis: stages planned one microbatch each, a schedule's in-flight activations,
  P2P bytes and bubble added (docs/planner.md, Pipeline parallelism);
- `search`: ``--search``, the meshes of N ranks pruned, planned at cut depths, scaled per layer and
  ranked by a stated time model.
"""

# The mesh axes the planner models (those of hypershard.tensor.axes.MESH_AXES, and HSDP's replicate
# axis, hs.fully_shard's `replicate_axis`: step.REPLICATE_AXIS); the CLIs refuse others.
PLANNED_AXES = ("pp", "dp_replicate", "dp", "tp", "ep", "cp")
