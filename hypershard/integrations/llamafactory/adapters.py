"""LoRA (peft) and freeze fine-tuning on hypershard DTensor base weights (docs/llamafactory.md,
"LoRA and freeze").

LlamaFactory's ``load_model`` hands the trainer a ``peft.PeftModel`` for ``finetuning_type: lora``:
every targeted ``nn.Linear`` at name N became a ``lora.Linear`` holding the original layer as
``N.base_layer`` and the adapters as ``N.lora_A.<adapter>`` ([r, in]) and ``N.lora_B.<adapter>``
([out, r]); ``additional_target`` modules became ``ModulesToSaveWrapper``s holding
``N.original_module`` and a trainable copy ``N.modules_to_save.<adapter>``. The HF plans name N.
`adapter_plan` rewrites a plan so that

- N keeps its style: its hooks (an output reduction, an input gather) go on the wrapper, around
  base + adapter, so a rowwise layer reduces ONE Partial sum, not two;
- the base layer's parameters get the style's layout by parameter keys (``N.base_layer.weight``):
  a parameter key sets the layout only, no hooks;
- the adapters follow the base weight's sharded dim: colwise (the base's output dim sharded):
  A [r, in] Replicate, B [out, r] sharded on out like the base, so ``B(A(x))`` comes out sharded
  on its last dim exactly as ``base(x)`` does and the two add locally, with no collective;
  rowwise (the base's input dim sharded, its input x sharded on its last dim): A [r, in] sharded
  on in like the base, so ``A(x)`` is a Partial(sum) of r values per token, B Replicate keeps it
  Partial, and the wrapper's one reduction sums base and adapter together; a base layer the plan
  leaves Replicate (routers, MLA's kv_a_proj, ...): both Replicate. The alternatives cost more:
  a sharded A under colwise would need its r-wide Partial reduced before B (a collective per
  call); a sharded B under rowwise would need x's shards gathered first.
- ``modules_to_save`` copies (and the original inside the wrapper) take N's layout.

Frozen parameters stay DTensors that never receive a gradient, so no dp reduction, no fully_shard
reduce-scatter and no optimizer state exists for them: HF's optimizer holds the parameters that
require grad only.
"""

from __future__ import annotations

import fnmatch
from typing import Optional

import torch
from torch import nn

__all__ = [
    "unwrap_peft",
    "adapter_plan",
    "check_finetuning",
    "save_adapter",
    "TrainableView",
]


def unwrap_peft(model: nn.Module) -> tuple:
    """(the HF model, the PeftModel or None). peft's tuner (LoraModel) calls ``self.model.forward``
    directly, which skips the HF model's hooks (hypershard's input sharding, fully_shard's root
    gather); it is made to call the module instead, so they run."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a LlamaFactory dependency
        return model, None
    if not isinstance(model, PeftModel):
        return model, None
    tuner = model.base_model
    inner = tuner.model
    if "forward" not in tuner.__dict__:
        tuner.forward = lambda *args, **kwargs: inner(*args, **kwargs)
    return inner, model


def _match(name: str, plan: dict) -> Optional[str]:
    for pattern, style_name in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style_name
    return None


def adapter_plan(model: nn.Module, plan: dict, fail) -> dict:
    """`plan` (module or parameter pattern -> style, as parallelize takes it, attention already laid
    out) with entries for every LoRA / modules_to_save wrapper of `model` (module docstring).
    `fail(why)` raises for a layout that cannot be honoured."""
    if not plan:
        return plan
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    from hypershard.parallel import style

    out = dict(plan)
    added: dict = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            module_style = _match(name, plan)
            weight_style = _match(f"{name}.weight", plan) or module_style
            bias_style = _match(f"{name}.bias", plan) or module_style
            if weight_style is None:
                continue  # everything Replicate on this axis
            if getattr(module, "lora_embedding_A", None) and len(module.lora_embedding_A):
                fail(
                    f"LoRA on {name!r}, an embedding the plan lays out as {weight_style!r}: not supported; "
                    f"allowed: lora_target without it (train it whole with additional_target)"
                )
            if not isinstance(base, nn.Linear):
                fail(
                    f"LoRA on {name!r} ({type(base).__name__}) which the plan lays out as {weight_style!r}: "
                    f"only nn.Linear base layers are laid out; allowed: lora_target of linear layers"
                )
            added[f"{name}.base_layer.weight"] = weight_style
            if base.bias is not None and bias_style is not None:
                added[f"{name}.base_layer.bias"] = bias_style
            dim = style(weight_style).param_dim(base, "weight", base.weight)
            for adapter in module.lora_A:
                if dim == 0:  # the output dim: B follows it (and lora_bias, on B, as the base's bias)
                    added[f"{name}.lora_B.{adapter}.weight"] = weight_style
                    if module.lora_B[adapter].bias is not None and bias_style is not None:
                        added[f"{name}.lora_B.{adapter}.bias"] = bias_style
                elif dim == 1:  # the input dim: A follows it
                    added[f"{name}.lora_A.{adapter}.weight"] = weight_style
        elif isinstance(module, ModulesToSaveWrapper):
            module_style = _match(name, plan)
            for param_name, _ in module.original_module.named_parameters():
                param_style = _match(f"{name}.{param_name}", plan) or module_style
                if param_style is None:
                    continue
                added[f"{name}.original_module.{param_name}"] = param_style
                for adapter in module.modules_to_save:
                    added[f"{name}.modules_to_save.{adapter}.{param_name}"] = param_style
    # parameter keys first: the first matching pattern wins in parallelize (exact names never
    # match another parameter)
    return {**added, **out}


def check_finetuning(finetuning_args, quantization=None, fail=None) -> str:
    """The fine-tuning type hypershard runs ("full", "freeze" or "lora"), or `fail(why)` for what it
    cannot: QLoRA (`quantization`: LlamaFactory's quantization_bit, or the model's quantization
    method; bitsandbytes' 4/8-bit kernels do not exist on CPU, and a quantized weight is not a
    tensor hypershard lays out), OFT, DoRA, PiSSA and LLaMA Pro (not covered by the tests)."""
    kind = getattr(finetuning_args, "finetuning_type", "full") if finetuning_args is not None else "full"
    if kind not in ("full", "freeze", "lora"):
        fail(f"finetuning_type={kind!r} is not supported; allowed: full, freeze, lora")
    if quantization is not None:
        fail(
            f"quantized base weights ({quantization}; QLoRA): bitsandbytes' quantized kernels do not exist on "
            f"CPU and a quantized weight cannot be laid out on a mesh; allowed: no quantization_bit (LoRA on "
            f"the bf16 / fp32 base weights)"
        )
    if kind == "lora":
        for flag in ("use_dora", "pissa_init", "use_llama_pro"):
            if getattr(finetuning_args, flag, False):
                fail(f"{flag}=true with LoRA is not supported (untested); allowed: {flag}: false")
    return kind


def _full(t: torch.Tensor) -> torch.Tensor:
    from hypershard import _C

    return t.full_tensor() if _C.is_dtensor(t) else t


def save_adapter(peft_model, output_dir: str, should_save: bool) -> None:
    """Writes peft's own adapter folder (adapter_config.json + adapter_model.safetensors) from the
    shards. Collective: every rank gathers the adapters' tensors (small: r x (in + out) per layer)
    in the same order; the main process writes them through ``PeftModel.save_pretrained``, so the
    keys and config are exactly what ``PeftModel.from_pretrained`` reads on one device."""
    from peft.utils import get_peft_model_state_dict

    state = peft_model.state_dict()
    # which tensors peft keeps (adapters, modules_to_save copies), found on stand-ins by identity:
    # peft renames keys (drops the adapter name) and reads them through each module's own view
    stand_ins = {k: torch.empty(0) for k in state}
    key_of = {id(t): k for k, t in stand_ins.items()}
    kept = get_peft_model_state_dict(peft_model, state_dict=stand_ins, save_embedding_layers=False)
    wanted = [key_of[id(t)] for t in kept.values()]
    with torch.no_grad():
        full = dict(stand_ins)
        for k in wanted:  # the same order on every rank: each full_tensor is a collective
            full[k] = _full(state[k]).detach().contiguous().clone()
    if should_save:
        peft_model.save_pretrained(output_dir, state_dict=full, safe_serialization=True, save_embedding_layers=False)


class TrainableView(nn.Module):
    """What a LoRA checkpoint holds: the parameters that require grad (adapters, modules_to_save),
    under the model's names. ``hypershard.checkpoint`` reads ``state_dict()`` and
    ``named_parameters()``; the frozen base comes from the pretrained folder on resume, on any
    mesh."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hs_model", model)  # not a submodule: its state is not ours

    def _trainable(self):
        return [(n, p) for n, p in self._hs_model.named_parameters(remove_duplicate=False) if p.requires_grad]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        for name, param in self._trainable():
            if remove_duplicate and id(param) in seen:
                continue
            seen.add(id(param))
            yield prefix + name, param

    def state_dict(self, *args, **kwargs):
        return {name: param.detach() for name, param in self._trainable()}
