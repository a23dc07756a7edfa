"""``hypershard.from_pretrained``: a HuggingFace model folder loaded straight into each rank's shards.

    model = hs.from_pretrained("Qwen3-8B/", mesh)                        # the model's TP/EP plans
    model = hs.from_pretrained(path, mesh, fully_shard=True, dtype=torch.bfloat16)

1. The config is read and the model built on the meta device (no parameter memory).
2. Every parameter and persistent buffer is matched with the checkpoint's tensors (headers only):
   direct names, the ``model.language_model.`` prefix of multimodal checkpoints, Mixtral's
   ``block_sparse_moe``, MoE experts stored one tensor per expert and projection
   (``experts.{e}.gate_proj/up_proj/down_proj.weight`` or ``w1/w3/w2``) for the module's fused
   ``experts.gate_up_proj`` [experts, 2 x intermediate, hidden] / ``experts.down_proj``, and fused
   experts stored transposed (Qwen3-VL-MoE). Tied parameters (``lm_head`` and the embeddings) are
   one tensor under several names: any of them in the files fills it. Shapes are checked here; a
   mismatch, a MoE weight with only some of its experts in the files, or (with
   ``init_missing=False``, or a model without ``_init_weights``) a missing tensor raises a
   ValueError naming it -- on every rank alike, before anything is distributed (the checks read the
   same files' headers and nothing else, and no collective has run yet).
3. ``parallelize`` (the TP / EP plans) and optionally ``fully_shard`` run on the meta model: they
   decide every parameter's Layout, register their hooks and check the plan (a dim the plan cannot
   shard raises there, before any collective) -- all without memory.
4. Each rank allocates its local shards only (``Layout.local_shape(rank)``) and copies into them
   the boxes they cover (``Layout.global_offset(rank)``) straight from the mapped files, a bounded
   slice at a time (hypershard/checkpoint/safetensors_io.py); parameters are then DTensors built from those
   locals, and fully_shard's groups are rebuilt on them.
5. Tensors the files lack are initialised as transformers' own from_pretrained would on one device:
   the modules are visited in ``initialize_weights``' order, each running the model's
   ``_init_weights``; the tensors that were loaded are zero-memory stand-ins (flagged initialised,
   so the init functions skip them -- but still CPU tensors of their shape, so an init that draws
   from a loaded tensor's device draws as on one device), and a missing one is generated WHOLE in a
   staging buffer, because reproducing one device's random stream needs every draw in order; the
   buffer lives from its module's visit to the end of its parent's (which may write it too), then
   each rank keeps its box of it and frees the rest. With ``seed``, the generator is
   seeded first: the values equal ``torch.manual_seed(seed); AutoModel...from_pretrained(folder)``.
   Non-persistent buffers (rotary ``inv_freq``) are computed the same way, never loaded.

No collective runs anywhere in the load. Peak memory per rank: its shards (model bytes / ranks for
a fully sharded model) + one reading slice (``staging_bytes``, default 16 MiB of mapped file) + the
missing tensors' staging buffers of one module's children (usually one tensor) + a fixed overhead
(docs/loading.md has the measurement).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import nn

from .. import _C
from .safetensors_io import DEFAULT_STAGING_BYTES, Reader, read_index

__all__ = ["from_pretrained", "load_into", "load_meta", "LoadReport", "fully_shard_layers"]

# Model types whose checkpoints store fused experts as [experts, in, out] (their modules hold
# [experts, out, in]): transformers transposes them at load (its conversion mapping).
_TRANSPOSED_EXPERTS = frozenset({"qwen3_vl_moe"})
# fused experts parameter -> the per-expert projections it packs along dim 1, per naming scheme.
_EXPERT_PARTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")


def _error(message: str) -> ValueError:
    return ValueError(f"hypershard: from_pretrained: {message}")


@dataclasses.dataclass
class LoadReport:
    """What a load did (``model.hs_load_report``)."""

    loaded: list = dataclasses.field(default_factory=list)  # model names filled from the files
    initialized: list = dataclasses.field(default_factory=list)  # model names initialised (missing)
    computed_buffers: list = dataclasses.field(default_factory=list)  # non-persistent buffers computed
    unused_keys: list = dataclasses.field(default_factory=list)  # checkpoint tensors no parameter took
    bytes_read: int = 0  # file bytes this rank read (its boxes; whole rows of column blocks)
    largest_slice: int = 0  # the largest file span one reading slice touched
    largest_init_staging: int = 0  # peak bytes of whole tensors held at once for initialisation
    local_bytes: int = 0  # bytes of this rank's parameter shards


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A checkpoint tensor that fills the box [at, at + size) of a model tensor. `dims[j]` is the
    model dim the tensor's dim j runs along; model dims not in `dims` have size 1 in the box."""

    entry: object
    at: tuple
    size: tuple
    dims: tuple


# ---------------------------------------------------------------------------------- matching


def _file_names(name: str):
    """The names a model tensor may be stored under, most likely first."""
    yield name
    if name.startswith("model."):
        yield "model.language_model." + name[len("model.") :]  # a multimodal checkpoint's text model
    if ".mlp." in name:
        yield name.replace(".mlp.", ".block_sparse_moe.")  # Mixtral


def _direct(name: str, shape: tuple, entries: dict, transposed: bool) -> Optional[list]:
    for key in _file_names(name):
        entry = entries.get(key)
        if entry is None:
            continue
        identity = tuple(range(len(shape)))
        if tuple(entry.shape) == shape:
            return [_Piece(entry, (0,) * len(shape), shape, identity)]
        flipped = (shape[0], shape[2], shape[1]) if len(shape) == 3 else None
        if transposed and _FUSED_EXPERTS.fullmatch(name) and tuple(entry.shape) == flipped:
            return [_Piece(entry, (0, 0, 0), shape, (0, 2, 1))]
        raise _error(
            f"checkpoint tensor {key!r} has shape {list(entry.shape)} but the model's {name!r} has "
            f"{list(shape)}; allowed: a checkpoint of this config"
        )
    return None


def _per_expert(name: str, shape: tuple, entries: dict) -> Optional[list]:
    match = _FUSED_EXPERTS.fullmatch(name)
    if match is None or len(shape) != 3:
        return None
    prefix, fused = match.groups()
    for base in _file_names(prefix):
        for parts in _EXPERT_PARTS[fused]:
            keys = [[f"{base}.{e}.{part}.weight" for part in parts] for e in range(shape[0])]
            present = [k for row in keys for k in row if k in entries]
            if not present:
                continue
            absent = [k for row in keys for k in row if k not in entries]
            if absent:
                raise _error(
                    f"the checkpoint holds {len(present)} of the {len(present) + len(absent)} per-expert "
                    f"tensors that make {name!r} but lacks {absent[:3]}; a fused weight cannot be "
                    "initialised in part; allowed: a checkpoint with every expert"
                )
            rows, rest = divmod(shape[1], len(parts))
            if rest:
                raise _error(f"{name!r} has {shape[1]} rows in dim 1, not {len(parts)} equal projections")
            pieces = []
            for e, row in enumerate(keys):
                for i, key in enumerate(row):
                    entry = entries[key]
                    if tuple(entry.shape) != (rows, shape[2]):
                        raise _error(
                            f"checkpoint tensor {key!r} has shape {list(entry.shape)} but expert {e} of "
                            f"the model's {name!r} needs {[rows, shape[2]]}; allowed: a checkpoint of "
                            "this config"
                        )
                    pieces.append(_Piece(entry, (e, i * rows, 0), (1, rows, shape[2]), (1, 2)))
            return pieces
    return None


def _tensors(model: nn.Module, buffers: bool, only_meta: bool = False) -> list:
    """[(names, shape)] of the model's parameters (or persistent buffers), one row per tensor
    (a tied tensor once, with all its names), in named_parameters order; `only_meta`: those on the
    meta device."""
    rows: dict = {}
    for module_name, module in model.named_modules():
        table = module._buffers if buffers else module._parameters
        for attr, tensor in table.items():
            if tensor is None or (buffers and attr in module._non_persistent_buffers_set):
                continue
            if only_meta and not tensor.is_meta:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            rows.setdefault(id(tensor), ([], tuple(tensor.shape)))[0].append(name)
    return list(rows.values())


def _match(
    model: nn.Module, entries: dict, init_missing: bool, rename: Optional[Callable] = None, only_meta: bool = False
) -> tuple:
    """({model name: [pieces] or None (missing)}, unused checkpoint keys). Raises on a shape
    mismatch, a partly stored fused weight, or a missing tensor that will not be initialised.
    `rename(model name) -> file name` (load_meta: a wrapper's names); `only_meta`: the tensors that
    are not on the meta device are not looked for."""
    transposed = getattr(getattr(model, "config", None), "model_type", None) in _TRANSPOSED_EXPERTS
    rename = rename or (lambda name: name)
    sources: dict = {}
    missing = []
    for names, shape in _tensors(model, False, only_meta) + _tensors(model, True, only_meta):
        pieces = None
        for name in names:
            pieces = _direct(rename(name), shape, entries, transposed) or _per_expert(rename(name), shape, entries)
            if pieces:
                break
        for name in names:
            sources[name] = pieces
        if pieces is None:
            missing.append(names[0])
    if missing:
        can_init = callable(getattr(model, "_init_weights", None)) and callable(
            getattr(model, "_initialize_weights", None)
        )
        if not init_missing or not can_init:
            why = (
                "init_missing=False"
                if can_init
                else f"{type(model).__name__} has no _init_weights to initialise them as one device would"
            )
            raise _error(
                f"the checkpoint lacks {len(missing)} tensor(s) of the model: {missing[:5]} ({why}); "
                "allowed: a checkpoint holding every parameter"
            )
    used = {piece.entry.key for pieces in sources.values() if pieces for piece in pieces}
    return sources, sorted(set(entries) - used)


# ---------------------------------------------------------------------------------- building


def _config(directory: Path):
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise _error(f"{str(directory)!r} has no config.json; allowed: a save_pretrained folder")
    return AutoConfig.from_pretrained(str(directory), local_files_only=True)


def _model_class(config, model_class):
    if model_class is not None:
        return model_class
    import transformers
    from transformers import AutoModelForCausalLM

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise _error(
            f"no causal-LM class for config {type(config).__name__} and no usable config.architectures; "
            "allowed: model_class=<a transformers model class>"
        ) from None


def _meta_model(cls, config, dtype: torch.dtype, attn_implementation: Optional[str]) -> nn.Module:
    """The model built as transformers' from_pretrained builds it: on the meta device, in `dtype`,
    without initialisation; its tied weights tied."""
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    contexts = (
        cls.get_init_context(dtype, False, False, None) if hasattr(cls, "get_init_context") else [torch.device("meta")]
    )
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        model = cls(config)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def fully_shard_layers(
    model: nn.Module, mesh, *, dp_axis: str = "dp", mp_policy=None, replicate_axis: Optional[str] = None
) -> nn.Module:
    """hs.fully_shard on every block of the model's decoder layers (the first ModuleList named
    ``*layers``) and then the root: the grouping the SFT entry point and from_pretrained use.
    `replicate_axis`: HSDP's (fully_shard's), Replicate across it, sharded over `dp_axis`."""
    from ..fsdp.fully_shard import fully_shard

    layers = next(
        (m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)), None
    )
    for layer in layers if layers is not None else []:
        fully_shard(layer, mesh, dp_axis=dp_axis, mp_policy=mp_policy, replicate_axis=replicate_axis)
    return fully_shard(model, mesh, dp_axis=dp_axis, mp_policy=mp_policy, replicate_axis=replicate_axis)


# ---------------------------------------------------------------------------------- materialising


def _box(tensor: torch.Tensor, rank: int) -> tuple:
    """(local shape, global offset) of this rank's part of a (meta) parameter."""
    if _C.is_dtensor(tensor):
        layout = _C.layout_of(tensor)
        return tuple(layout.local_shape(rank)), tuple(layout.global_offset(rank))
    return tuple(tensor.shape), (0,) * tensor.dim()


def _fill(reader: Reader, local: torch.Tensor, offset: tuple, pieces: list) -> None:
    """Copies into `local` (the box at `offset` of its tensor) what each piece holds of it."""
    for piece in pieces:
        lo = [max(o, a) for o, a in zip(offset, piece.at)]
        hi = [min(o + n, a + s) for o, n, a, s in zip(offset, local.shape, piece.at, piece.size)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        view = local[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset))]
        for d in sorted(set(range(local.dim())) - set(piece.dims), reverse=True):
            view = view.select(d, 0)  # a dim the file tensor lacks (an expert index): size 1 in the box
        kept = sorted(piece.dims)
        view = view.permute([kept.index(d) for d in piece.dims])
        starts = [lo[d] - piece.at[d] for d in piece.dims]
        sizes = [hi[d] - lo[d] for d in piece.dims]
        reader.copy_box(piece.entry, starts, sizes, view)


def _new_param(old: nn.Parameter, local: torch.Tensor) -> nn.Parameter:
    if _C.is_dtensor(old):
        value = _C.from_local(local, _C.device_mesh_of(old), _C.layout_of(old))
    else:
        value = local
    return nn.Parameter(value, requires_grad=old.requires_grad)


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of `tensor`'s shape and dtype holding one element (an expand), flagged as
    initialised: transformers' init functions skip it, and code that asks its device gets CPU."""
    standin = torch.empty((), dtype=tensor.dtype).expand(tensor.shape)
    standin._is_hf_initialized = True
    return standin


def _initialize(model: nn.Module, pending: dict, buffers: dict, report: LoadReport) -> None:
    """Runs the model's _init_weights on every module in transformers' initialize_weights order
    (children first; a nested PreTrainedModel with its own _init_weights). `pending`: id(param)
    -> (local, offset) of the parameters the files lack; `buffers`: id(buffer) -> a real CPU buffer
    to compute (missing persistent buffers, non-persistent ones). Everything else is a stand-in.

    A module's _init_weights may write its children's tensors too (a MoE block initialises its
    router's weight), so each visit sees its whole subtree, and a missing parameter's staging
    buffer lives from its module's visit to the end of its parent's, when this rank keeps its box."""
    from transformers import PreTrainedModel
    from transformers import initialization as init

    custom = model.is_custom_code() if hasattr(model, "is_custom_code") else False
    staging: dict = {}  # id(param) -> the whole tensor being initialised
    live = [0]  # bytes of the staging buffers held now

    def finish(owner: nn.Module) -> None:
        for param in owner._parameters.values():
            if param is not None and id(param) in staging:
                local, offset = pending.pop(id(param))
                whole = staging.pop(id(param))
                local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])
                live[0] -= whole.numel() * whole.element_size()

    def swap(module: nn.Module) -> list:
        saved = []
        for sub in module.modules():
            saved.append((sub, dict(sub._parameters), dict(sub._buffers)))
            for attr, param in list(sub._parameters.items()):
                if param is None:
                    continue
                if id(param) in pending:
                    if id(param) not in staging:
                        # The whole tensor, generated in this staging buffer: one device's random
                        # stream draws it whole, in this order; this rank keeps only its box of it.
                        staging[id(param)] = torch.empty(param.shape, dtype=param.dtype)
                        live[0] += staging[id(param)].numel() * staging[id(param)].element_size()
                        report.largest_init_staging = max(report.largest_init_staging, live[0])
                    sub._parameters[attr] = staging[id(param)]
                else:
                    sub._parameters[attr] = _stand_in(param)
            for attr, buffer in list(sub._buffers.items()):
                if buffer is not None:
                    real = buffers.get(id(buffer))
                    sub._buffers[attr] = real if real is not None else _stand_in(buffer)
        return saved

    def visit(module: nn.Module, owner: nn.Module) -> None:
        for child in module.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        saved = swap(module)
        # transformers' _initialize_weights skips a module flagged by an earlier pass (it sets the
        # flag after each _init_weights): LlamaFactory's meta build runs one (loading.py) before
        # load_meta's, which would then leave the computed buffers (rotary inv_freq) uninitialised
        # memory. Here what must not be written is a stand-in, so every module runs (and ends flagged,
        # as after transformers' own load).
        module.__dict__.pop("_is_hf_initialized", None)
        try:
            owner._initialize_weights(module, custom)
            for sub, _, old_buffers in saved:  # a computed buffer keeps its (possibly new) tensor
                for attr, buffer in old_buffers.items():
                    if buffer is not None and id(buffer) in buffers:
                        buffers[id(buffer)] = sub._buffers[attr]
        finally:
            for sub, params, old_buffers in saved:
                sub._parameters.update(params)
                sub._buffers.update(old_buffers)
        for child in module.children():  # their last writer (this module) has run
            finish(child)

    with torch.no_grad(), init.guard_torch_init_functions():
        visit(model, model)
        finish(model)
    assert not pending, "parameters left uninitialised"


def _materialize(
    model: nn.Module, mesh, sources: dict, reader: Reader, dp_axis: str, seed: Optional[int], report: LoadReport
) -> None:
    rank = mesh.rank if mesh is not None else 0  # (a pipeline on a pp-only mesh: plain tensors)
    replaced: dict = {}  # id(meta param) -> new param
    pending: dict = {}  # id(meta param) -> (local, offset): to initialise
    for module_name, module in model.named_modules():
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced and not param.is_meta:
                replaced[id(param)] = (param, param)  # built by the caller (load_meta): kept
            if id(param) not in replaced:
                name = f"{module_name}.{attr}" if module_name else attr
                shape, offset = _box(param, rank)
                local = torch.empty(shape, dtype=param.dtype)
                if sources.get(name):
                    _fill(reader, local, offset, sources[name])
                    report.loaded.append(name)
                else:
                    pending[id(param)] = (local, offset)
                    report.initialized.append(name)
                report.local_bytes += local.numel() * local.element_size()
                replaced[id(param)] = (_new_param(param, local), param)
            module._parameters[attr] = replaced[id(param)][0]
    buffers: dict = {}  # id(meta buffer) -> its real tensor, to compute
    filled: dict = {}  # id(meta buffer) -> its real tensor, read from the files (whole: buffers are never sharded)
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is None or id(buffer) in buffers or id(buffer) in filled or not buffer.is_meta:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            real = torch.empty(buffer.shape, dtype=buffer.dtype)
            if attr not in module._non_persistent_buffers_set and sources.get(name):
                _fill(reader, real, (0,) * real.dim(), sources[name])
                filled[id(buffer)] = real
                report.loaded.append(name)
            else:
                buffers[id(buffer)] = real
                (report.computed_buffers if attr in module._non_persistent_buffers_set else report.initialized).append(
                    name
                )
    if pending or buffers:
        # _initialize sees the meta parameters again (it keys on their ids): put them back meanwhile.
        originals = {id(new): old for new, old in replaced.values()}
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None and id(param) in originals:
                    module._parameters[attr] = originals[id(param)]
        if seed is not None:
            torch.manual_seed(seed)
        try:
            _initialize(model, pending, buffers, report)
        finally:
            for module in model.modules():
                for attr, param in module._parameters.items():
                    if param is not None and id(param) in replaced:
                        module._parameters[attr] = replaced[id(param)][0]
    for module in model.modules():
        for attr, buffer in module._buffers.items():
            if buffer is not None and (id(buffer) in buffers or id(buffer) in filled):
                module._buffers[attr] = buffers.get(id(buffer), filled.get(id(buffer)))
            elif buffer is not None and buffer.is_meta:
                raise AssertionError(f"buffer {attr} of {type(module).__name__} left on meta")
    _rebuild_fully_shard_groups(model, {old: new for old, (new, _) in replaced.items()}, mesh, dp_axis)


def _rebuild_fully_shard_groups(model: nn.Module, replaced: dict, mesh, dp_axis: str) -> None:
    """fully_shard ran on the meta model: its groups hold meta shards. Each group gets the real
    shards and a new C++ group (the collectives' flat buffers) built on them."""
    if not any(hasattr(m, "_hs_fully_shard") for m in model.modules()):
        return
    axis = list(mesh.mesh_dim_names).index(dp_axis)
    for module in model.modules():
        group = getattr(module, "_hs_fully_shard", None)
        if group is None:
            continue
        group.params = [replaced[id(p)] for p in group.params]
        unsharded = []
        for param in group.params:
            layout = _C.layout_of(param)  # fully_shard's layout: dp the minor axis of dim 0
            dims = [list(axes) for axes in layout.dim_axes]
            dims[0] = [a for a in dims[0] if a != axis]
            unsharded.append(_C.Layout.create(layout.mesh, layout.global_shape, dims, list(layout.partial)))
        mp = group.mp
        group.cgroup = _C.FullyShardGroup(
            group.params,
            unsharded,
            axis,
            mp.param_dtype if mp else None,
            (mp.reduce_dtype or mp.param_dtype) if mp else None,
        )
        group.put(group.params)


# ---------------------------------------------------------------------------------- the API


def from_pretrained(
    directory,
    mesh,
    *,
    plan=None,
    ep_plan=None,
    fully_shard: Union[bool, Callable] = False,
    mp_policy=None,
    dtype: torch.dtype = torch.float32,
    model_class=None,
    attn_implementation: Optional[str] = "sdpa",
    init_missing: bool = True,
    seed: Optional[int] = None,
    tp_axis: str = "tp",
    dp_axis: str = "dp",
    ep_axis: str = "ep",
    shard_inputs: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> nn.Module:
    """Loads the HuggingFace model folder `directory` (config.json + safetensors) onto `mesh`,
    each rank reading and holding only its shards. Every rank calls it with the same arguments.

    `plan` / `ep_plan` / `tp_axis` / `dp_axis` / `ep_axis` / `shard_inputs`: as hs.parallelize (None:
    the model's own plans). `fully_shard`: True shards every decoder layer and then the root over
    `dp_axis` (fully_shard_layers, with `mp_policy`); a callable ``f(model, mesh)`` applies
    fully_shard its own way (it runs on the meta model). `dtype`: of the parameters (the files'
    tensors are converted). `model_class`: default config.architectures, else the
    AutoModelForCausalLM class of the config. `init_missing`: initialise tensors the files lack as
    transformers does on one device (with `seed`: after torch.manual_seed(seed)); False raises
    instead. `staging_bytes`: the most file bytes one read slice spans.

    Returns the model in eval mode (as transformers' from_pretrained), with ``hs_load_report``
    (a LoadReport). Raises ValueError on bad input -- a missing or mis-shaped tensor, a plan that
    cannot shard a dim -- on every rank, before any collective.

    A mesh with a pp axis is hypershard.pipelining.from_pretrained's (what hs.from_pretrained is):
    it builds the pipeline's stages and fills them with this module's reader."""
    from ..parallel.api import parallelize

    directory = Path(directory)
    config = _config(directory)
    cls = _model_class(config, model_class)
    entries = read_index(directory)
    model = _meta_model(cls, config, dtype, attn_implementation)
    sources, unused = _match(model, entries, init_missing)
    if fully_shard is True and dp_axis not in mesh.mesh_dim_names:
        raise _error(f"fully_shard=True needs a {dp_axis!r} axis; the mesh has {list(mesh.mesh_dim_names)}")
    checks = _C.check_replicas()
    _C.set_check_replicas(False)  # the debug checks compare values (a collective); meta tensors have none
    try:
        parallelize(
            model,
            mesh,
            plan,
            tp_axis=tp_axis,
            dp_axis=dp_axis,
            ep_axis=ep_axis,
            ep_plan=ep_plan,
            shard_inputs=shard_inputs,
        )
        if callable(fully_shard):
            fully_shard(model, mesh)
        elif fully_shard:
            fully_shard_layers(model, mesh, dp_axis=dp_axis, mp_policy=mp_policy)
    finally:
        _C.set_check_replicas(checks)
    report = LoadReport(unused_keys=unused)
    with Reader(staging_bytes) as reader:
        _materialize(model, mesh, sources, reader, dp_axis, seed, report)
        report.bytes_read, report.largest_slice = reader.bytes_read, reader.largest_slice
    model.hs_load_report = report
    return model.eval()


def load_into(model: nn.Module, directory, *, staging_bytes: int = DEFAULT_STAGING_BYTES) -> LoadReport:
    """Loads the folder's tensors into `model`'s existing parameters and persistent buffers in
    place (DTensors: into this rank's shards only, read as from_pretrained reads them; fully
    sharded models between steps). Every tensor must be in the files (missing or mis-shaped ones
    raise before anything is written). Not a collective."""
    entries = read_index(Path(directory))
    sources, unused = _match(model, entries, init_missing=False)
    report = LoadReport(unused_keys=unused)
    done: set = set()
    with Reader(staging_bytes) as reader, torch.no_grad():
        for module_name, module in model.named_modules():
            for table in (module._parameters, module._buffers):
                for attr, tensor in table.items():
                    if tensor is None or id(tensor) in done or attr in module._non_persistent_buffers_set:
                        continue
                    done.add(id(tensor))
                    name = f"{module_name}.{attr}" if module_name else attr
                    if _C.is_dtensor(tensor):
                        local = _C.local_of(tensor)
                        _, offset = _box(tensor, _C.device_mesh_of(tensor).rank)
                    else:
                        local, offset = tensor.data, (0,) * tensor.dim()
                    _fill(reader, local, offset, sources[name])
                    report.loaded.append(name)
                    report.local_bytes += local.numel() * local.element_size()
        report.bytes_read, report.largest_slice = reader.bytes_read, reader.largest_slice
    return report


def load_meta(
    model: nn.Module,
    directory,
    mesh,
    *,
    rename: Optional[Callable] = None,
    dp_axis: str = "dp",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> LoadReport:
    """Fills the meta tensors of `model` -- built on meta and laid out there (hs.parallelize,
    hs.fully_shard), as from_pretrained's steps 1 and 3 leave it -- from the folder, each rank
    reading and allocating only its shards (step 4); non-persistent buffers are computed (step 5).
    Tensors already off meta (built by the caller: LoRA adapters) are kept as they are.
    `rename(model name) -> file name` for a model wrapped after its build (peft's ``base_layer``).
    Every meta tensor must be in the files. The global generator is left as it was (the init pass
    that computes the buffers draws nothing that is kept: whatever an _init_weights draws for a
    loaded tensor is discarded). Not a collective; sets ``model.hs_load_report``."""
    entries = read_index(Path(directory))
    sources, unused = _match(model, entries, init_missing=False, rename=rename, only_meta=True)
    report = LoadReport(unused_keys=unused)
    with Reader(staging_bytes) as reader, torch.random.fork_rng(devices=[]):
        _materialize(model, mesh, sources, reader, dp_axis, None, report)
        report.bytes_read, report.largest_slice = reader.bytes_read, reader.largest_slice
    model.hs_load_report = report
    return report
