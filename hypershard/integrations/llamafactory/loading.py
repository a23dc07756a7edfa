"""Shard-wise loading on LlamaFactory's path: no rank holds weights it does not own.

LlamaFactory's sft workflow calls its ``load_model`` (transformers' ``from_pretrained`` of the
whole model, then its patcher, the fine-tuning setup and peft) on every rank, and hands the model
to ``HyperParallelTrainer``. The launcher wraps that ``load_model`` (``install``) so that:

1. the Auto class's ``from_pretrained`` builds the model on the meta device instead (the class,
   dtype and tied weights transformers would give it; ``hs.from_pretrained``'s ``_meta_model``),
   after checking the folder's safetensors headers hold every tensor of it;
2. everything LlamaFactory does next runs on that meta model unchanged: the patcher
   (``prepare_model_for_training``'s casts, gradient checkpointing, the vision tower freeze), the
   fine-tuning setup (its fp32 casts of the trainable weights change a meta tensor's dtype, no
   memory) and peft. peft draws the LoRA A matrices on CPU from the global generator as on one
   device, then would move them to the base weight's device -- meta, losing them: while the wrapper
   runs, an adapter of a meta base only takes the base's dtype (as peft casts it) and stays on CPU
   (``_move_adapter_to_device_of_base_layer``, ``LoraModel._replace_module``);
3. the trainer lays the model out on meta (``hs.parallelize``, ``hs.fully_shard``) and then
   ``materialize`` fills each rank's shards straight from the files
   (``hypershard.checkpoint.pretrained.load_meta``: one reading slice at a time, no collective),
   leaving the real tensors (the LoRA adapters) as they are.

What still loads whole, and why (the reason is logged on rank 0): a folder that is not local or
holds no safetensors; a checkpoint that lacks tensors of the model (transformers initialises
them with random draws BEFORE peft draws its adapters: on the meta path they would come after);
``resize_vocab`` (the new embedding rows are the mean of the old ones: values); an
``adapter_name_or_path`` (merged into the base: values); ``train_from_scratch``, unsloth,
mixture-of-depths, value heads; and what the trainer refuses with its own message (QLoRA, DoRA,
PiSSA, LLaMA Pro, OFT), so that message is what the user sees. ``HYPERSHARD_LLAMAFACTORY_LOAD=whole``
forces the whole load (a comparison, the benchmark's "before").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Optional

import torch

__all__ = ["install", "materialize", "rss_text", "SHARDED_ATTR", "LOAD_ENV"]

SHARDED_ATTR = "_hs_sharded_load"  # on the HF model built on meta: a _Pending
LOAD_ENV = "HYPERSHARD_LLAMAFACTORY_LOAD"  # "whole": LlamaFactory's own load on every rank


@dataclasses.dataclass
class _Pending:
    directory: Path


def _rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _log(message: str) -> None:
    if _rank0():
        print(f"hypershard: llamafactory: {message}", flush=True)


def _whole_reason(model_args, finetuning_args, is_trainable: bool, add_valuehead: bool) -> Optional[str]:
    """Why this load must be LlamaFactory's own (whole on every rank), or None."""
    if os.environ.get(LOAD_ENV, "").lower() == "whole":
        return f"{LOAD_ENV}=whole"
    path = Path(str(model_args.model_name_or_path))
    if not path.is_dir():
        return f"{str(path)!r} is not a local folder (the shard-wise reader reads local safetensors)"
    checks = [
        (add_valuehead, "a value head (not the sft stage)"),
        (getattr(model_args, "use_unsloth", False), "use_unsloth (unsloth's own loader)"),
        (getattr(model_args, "mixture_of_depths", None), "mixture_of_depths (converts a loaded model)"),
        (getattr(model_args, "train_from_scratch", False), "train_from_scratch (nothing to read)"),
        (
            getattr(model_args, "adapter_name_or_path", None),
            "adapter_name_or_path (peft merges the adapter into the base weights' values)",
        ),
        (
            getattr(model_args, "resize_vocab", False),
            "resize_vocab (new embedding rows are initialised from the values of the old ones)",
        ),
        (getattr(model_args, "quantization_bit", None) is not None, "quantization_bit (refused by the trainer)"),
    ]
    kind = getattr(finetuning_args, "finetuning_type", "full")
    if kind not in ("full", "freeze", "lora"):
        checks.append((True, f"finetuning_type={kind!r} (refused by the trainer)"))
    if kind == "lora":
        for flag in ("use_dora", "pissa_init", "use_llama_pro"):
            checks.append((getattr(finetuning_args, flag, False), f"{flag} (refused by the trainer)"))
    for hit, why in checks:
        if hit:
            return why
    return None


def _resolve_dtype(dtype, config, entries: dict) -> torch.dtype:
    """transformers' from_pretrained ``dtype="auto"``: the config's dtype, else the first floating
    tensor's of the files, else the default."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        stored = getattr(config, "dtype", None)
        if stored is not None:
            return getattr(torch, stored) if isinstance(stored, str) else stored
        for entry in entries.values():
            if entry.dtype.is_floating_point:
                return entry.dtype
        return torch.get_default_dtype()
    return getattr(torch, dtype)


def _keep_in_fp32(model, dtype: torch.dtype) -> None:
    """transformers' dtype plan (``_keep_in_fp32_modules[_strict]``), applied on meta as
    from_pretrained applies it while loading."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    alternation, _, _ = build_glob_alternation(list(plan))
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                name = f"{module_name}.{attr}" if module_name else attr
                if tensor is not None and tensor.is_floating_point() and alternation.search(name):
                    table[attr] = (
                        torch.nn.Parameter(tensor.to(torch.float32), requires_grad=tensor.requires_grad)
                        if isinstance(tensor, torch.nn.Parameter)
                        else tensor.to(torch.float32)
                    )


class _WholeLoad(Exception):
    """The meta build found a reason to load whole (raised before anything was built)."""


def _meta_from_pretrained(auto_cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
    """What the Auto class's from_pretrained gives, on the meta device (the module docstring)."""
    from transformers.models.auto.auto_factory import _get_model_class

    from hypershard.checkpoint import pretrained
    from hypershard.checkpoint.safetensors_io import read_index

    directory = Path(str(pretrained_model_name_or_path))
    if args or config is None:
        raise _WholeLoad("from_pretrained called without a config (not LlamaFactory's load_model)")
    try:
        entries = read_index(directory)
    except ValueError as error:
        raise _WholeLoad(f"the folder's safetensors cannot be read shard-wise ({error})") from None
    try:
        cls = _get_model_class(config, auto_cls._model_mapping)
    except (KeyError, ValueError) as error:
        raise _WholeLoad(f"no model class for {type(config).__name__} ({error})") from None
    dtype = _resolve_dtype(kwargs.get("dtype", kwargs.get("torch_dtype", "auto")), config, entries)
    model = pretrained._meta_model(cls, config, dtype, None)
    _keep_in_fp32(model, dtype)
    try:
        pretrained._match(model, entries, init_missing=False)
    except ValueError as error:
        # Missing tensors are initialised by transformers with random draws before peft draws its
        # adapters; read after peft, the draws would come in another order. Mis-shaped ones:
        # transformers' own message.
        raise _WholeLoad(f"the checkpoint does not hold every tensor of the model as it is ({error})") from None
    # transformers' load runs every module's _init_weights with the loaded tensors flagged done; some
    # still draw numbers (Qwen3.5's A_log draws on the loaded tensor's device). Those draws happen
    # here, before peft draws its adapters, as on one device (load_meta leaves the generator alone).
    with torch.no_grad():
        pretrained._initialize(model, {}, {}, pretrained.LoadReport())
    generation = directory / "generation_config.json"
    if generation.is_file() and model.can_generate():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model.name_or_path = str(directory)
    setattr(model, SHARDED_ATTR, _Pending(directory))
    return model.eval()


@contextlib.contextmanager
def _meta_loading(state: dict):
    """Within: the Auto classes' from_pretrained builds on meta (once), and peft keeps the
    adapters of a meta base layer on CPU."""
    from llamafactory.model import loader
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    # the Auto classes load_model picks from (each holds its own copy of from_pretrained)
    classes = {
        v
        for v in vars(loader).values()
        if isinstance(v, type) and issubclass(v, _BaseAutoModelClass) and "from_pretrained" in v.__dict__
    }
    real = {cls: cls.__dict__["from_pretrained"] for cls in classes}
    real_move = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def meta_build(real_from_pretrained):
        def from_pretrained(cls, *args, **kwargs):
            if state.get("built"):
                return real_from_pretrained.__func__(cls, *args, **kwargs)
            state["built"] = True
            try:
                return _meta_from_pretrained(cls, *args, **kwargs)
            except _WholeLoad as why:
                state["whole"] = str(why)
                return real_from_pretrained.__func__(cls, *args, **kwargs)

        return classmethod(from_pretrained)

    def move(self, adapter_name, device=None):
        weight = getattr(self.get_base_layer(), "weight", None)
        if device is not None or weight is None or not weight.is_meta:
            return real_move(self, adapter_name, device)
        # peft's own move, less the device: the adapter keeps its values (drawn on CPU)
        for layer_name in self.adapter_layer_names + self.other_param_names:
            layer = getattr(self, layer_name, None)
            if isinstance(layer, torch.nn.ModuleDict) and adapter_name in layer:
                if weight.dtype.is_floating_point or weight.dtype.is_complex:
                    layer[adapter_name] = layer[adapter_name].to(dtype=weight.dtype)

    real_replace = LoraModel._replace_module

    def replace(self, parent, child_name, new_module, child):
        # peft then moves the new adapters to the base weight's device: on meta, put them back
        values = [
            (module, attr, param.data)
            for module in new_module.modules()
            for attr, param in module._parameters.items()
            if param is not None and not param.is_meta
        ]
        real_replace(self, parent, child_name, new_module, child)
        for module, attr, value in values:
            param = module._parameters[attr]
            if param is not None and param.is_meta:
                module._parameters[attr] = torch.nn.Parameter(value, requires_grad=param.requires_grad)

    for cls, method in real.items():
        cls.from_pretrained = meta_build(method)
    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    LoraModel._replace_module = replace
    try:
        yield
    finally:
        for cls, method in real.items():
            cls.from_pretrained = method
        BaseTunerLayer._move_adapter_to_device_of_base_layer = real_move
        LoraModel._replace_module = real_replace


def sharded_load_model(load_model):
    """LlamaFactory's ``load_model``, building on meta where it can (module docstring)."""

    @functools.wraps(load_model)
    def wrapper(tokenizer, model_args, finetuning_args, is_trainable=False, add_valuehead=False):
        global LOAD_STARTED
        LOAD_STARTED = time.perf_counter()  # the trainer's load line reports the time from here
        why = _whole_reason(model_args, finetuning_args, is_trainable, add_valuehead)
        if why is not None:
            _log(f"every rank loads the whole model (LlamaFactory's load_model): {why}")
            return load_model(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead)
        state: dict = {}
        with _meta_loading(state):
            model = load_model(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead)
        if "whole" in state or not state.get("built"):
            why = state.get("whole", "load_model did not call an Auto class's from_pretrained")
            _log(f"every rank loads the whole model (LlamaFactory's load_model): {why}")
        else:
            _log(
                f"the model is built on the meta device and each rank will read only its shards from "
                f"{model_args.model_name_or_path} (hs.from_pretrained's reader)"
            )
        return model

    wrapper._hs_sharded = True
    return wrapper


# perf_counter() when LlamaFactory's load_model was entered (None before): the load the trainer's load
# line times runs from here to the model distributed and, when sharded, filled with its shards
LOAD_STARTED: Optional[float] = None


def load_seconds_text() -> str:
    """ "; load 12.3 s" since load_model was entered, or "" when it was not called through us."""
    return "" if LOAD_STARTED is None else f"; load {time.perf_counter() - LOAD_STARTED:.1f} s"


def install() -> None:
    """Wraps the load_model of LlamaFactory's hyper_parallel sft workflow (the launcher's process)."""
    from llamafactory.train.hyper_parallel import workflow

    if not getattr(workflow.load_model, "_hs_sharded", False):
        workflow.load_model = sharded_load_model(workflow.load_model)


def _file_name(name: str) -> str:
    """A peft-wrapped parameter's name in the pretrained folder: ``q_proj.base_layer.weight`` ->
    ``q_proj.weight``, ``lm_head.original_module.weight`` / ``lm_head.modules_to_save.default.weight``
    -> ``lm_head.weight``."""
    parts = name.split(".")
    out = []
    i = 0
    while i < len(parts):
        if parts[i] in ("base_layer", "original_module"):
            i += 1
        elif parts[i] == "modules_to_save" and i + 1 < len(parts):
            i += 2  # and the adapter name
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def materialize(model: torch.nn.Module, mesh, dp_axis: str = "dp"):
    """Fills each rank's shards of the meta tensors of `model` (laid out already) from the folder
    its meta build came from; returns the LoadReport, or None for a model loaded whole."""
    pending = getattr(model, SHARDED_ATTR, None)
    if pending is None:
        return None
    from hypershard.checkpoint.pretrained import load_meta

    report = load_meta(model, pending.directory, mesh, rename=_file_name, dp_axis=dp_axis)
    delattr(model, SHARDED_ATTR)
    return report


def rss_text() -> str:
    """ "RSS 812.3 MB, peak 1024.0 MB" of this process (/proc/self/status; MB = 10^6 bytes), or
    what cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        rss, peak = (int(fields[k].split()[0]) * 1024 / 1e6 for k in ("VmRSS", "VmHWM"))
    except (OSError, KeyError, ValueError):
        return "RSS unknown (no /proc/self/status)"
    return f"RSS {rss:.1f} MB, peak {peak:.1f} MB"
