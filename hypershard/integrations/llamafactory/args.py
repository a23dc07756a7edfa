"""HyperParallelArguments: the JSON file that LlamaFactory's ``hyper_parallel_args`` names, read and
checked before anything is distributed.

LlamaFactory only passes the file's path (``finetuning_args.hyper_parallel_args``); everything
about the mesh lives here. Checks that need the world size or the model (tp_size dividing the world,
tp_size against the attention heads, ep_size against the experts) run in `check_world` /
`check_model`, on every rank, so every rank stops with the same one-line message instead of one
rank failing inside a collective while the others wait for it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional, Union

import torch

__all__ = ["HyperParallelArguments", "HyperParallelConfigError"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


RECOMPUTE = ("auto", "full", "selective", "none")


def _mesh_axes() -> tuple:
    """The mesh axes hypershard gives a meaning to (hypershard.MESH_AXES)."""
    from hypershard.tensor.axes import MESH_AXES

    return tuple(MESH_AXES)


class HyperParallelConfigError(ValueError):
    """A hyper_parallel_args file that cannot be honoured; the message names the key and what is allowed."""


@dataclasses.dataclass
class HyperParallelArguments:
    """The strategy of one run. The mesh is (dp, cp, ep, tp), row-major over the torchrun ranks,
    with dp = world / (cp_size x tp_size x ep_size) unless dp_size says it (then it must match).

    - ``tp_size``: tensor parallelism with the model's HF ``base_model_tp_plan`` (or ``tp_plan``);
    - ``ep_size``: expert parallelism with the model's ``base_model_ep_plan`` (or ``ep_plan``);
    - ``cp_size``: context parallelism, the sequence split over cp ranks (LlamaFactory's
      ``hyper_parallel_cp_size`` where its version has it), attention by ``cp_algorithm``
      ("all_gather_kv", "ulysses" or "ring", as hypershard.parallelize);
    - ``fully_shard``: hs.fully_shard on every decoder layer and the root (parameters, gradients and
      optimizer states 1/dp per rank), with ``reshard_after_forward``;
    - ``param_dtype`` / ``reduce_dtype``: hs.mixed_precision's policy on any mesh (names of torch
      dtypes, e.g. "bfloat16"): compute in param_dtype from the model's own (master) weights,
      gradients summed in reduce_dtype; ``param_dtype: "auto"`` (the default): bfloat16 (gradients
      summed in float32) for a bfloat16 checkpoint when the YAML asks for neither bf16 nor fp16,
      else none (`precision`);
    - ``recompute``: "auto" (the default): LlamaFactory's own recomputation (transformers' gradient
      checkpointing, on unless disable_gradient_checkpointing) as it is; "full" / "selective":
      hs.recompute on every decoder layer instead; "none": nothing recomputed;
    - ``strict``: run every op through a distributed rule (hs.strict), no gather fallback.
    """

    tp_size: int = 1
    ep_size: int = 1
    cp_size: int = 1
    dp_size: Optional[int] = None
    cp_algorithm: str = "all_gather_kv"
    recompute: str = "auto"
    fully_shard: bool = False
    reshard_after_forward: bool = True
    param_dtype: Optional[str] = "auto"
    reduce_dtype: Optional[str] = None
    tp_plan: Union[str, dict] = "auto"
    ep_plan: Union[str, dict] = "auto"
    strict: bool = False
    source: Optional[str] = dataclasses.field(default=None, compare=False)  # the file, for messages

    # ----------------------------------------------------------------------------- construction

    @classmethod
    def keys(cls) -> list:
        return [f.name for f in dataclasses.fields(cls) if f.name != "source"]

    @classmethod
    def from_dict(cls, values: dict, source: Optional[str] = None) -> "HyperParallelArguments":
        where = f"hyper_parallel_args {source}" if source else "hyper_parallel_args"
        if not isinstance(values, dict):
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: {where}: expected a JSON object, got "
                f"{type(values).__name__}; allowed keys: {cls.keys()}"
            )
        unknown = sorted(set(values) - set(cls.keys()))
        if "pp_size" in unknown:  # a mesh axis, but not one HF's Trainer loop can run (docs/llamafactory.md)
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: {where}: pp_size: pipeline parallelism does not run under HF's "
                "Trainer (its training_step runs each micro-batch's forward and backward itself; a pipeline "
                "schedule's step runs every microbatch of the batch); allowed: tp_size, ep_size, cp_size, "
                "dp_size here, or python -m hypershard.sft --mesh pp=N,dp=M (docs/pipelining.md)"
            )
        sizes = sorted(k for k in unknown if k.endswith("_size"))
        if sizes:  # a mesh axis: hypershard's list of axes says which exist
            axes = _mesh_axes()
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: {where}: unknown key(s) {unknown}: {sizes} name(s) no mesh axis; "
                f"allowed sizes: {[a + '_size' for a in axes if a + '_size' in cls.keys()]} (mesh axes "
                f"{list(axes)}), other keys: {[k for k in cls.keys() if not k.endswith('_size')]}"
            )
        if unknown:
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: {where}: unknown key(s) {unknown}; allowed: {cls.keys()}"
            )
        args = cls(**values, source=source)
        args._check_types(where)
        return args

    @classmethod
    def from_file(cls, path) -> "HyperParallelArguments":
        path = Path(path)
        if not path.is_file():
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: hyper_parallel_args {str(path)!r} is not a "
                f"file; allowed: the path of a JSON file"
            )
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise HyperParallelConfigError(
                f"hypershard: llamafactory: hyper_parallel_args {path}: not valid JSON ({error})"
            ) from None
        return cls.from_dict(values, source=str(path))

    @classmethod
    def from_finetuning_args(cls, finetuning_args) -> "HyperParallelArguments":
        """What LlamaFactory's workflow calls: its ``hyper_parallel_args`` is the JSON file's path
        (no file: every default, i.e. plain data parallelism over all ranks)."""
        path = getattr(finetuning_args, "hyper_parallel_args", None)
        args = cls.from_file(path) if path else cls()
        cp = getattr(finetuning_args, "hyper_parallel_cp_size", None)  # newer LlamaFactory's YAML key
        if cp is not None and cp != 1:
            if args.cp_size not in (1, cp):
                args._fail(
                    f"cp_size={args.cp_size} but the YAML's hyper_parallel_cp_size={cp}; allowed: one of them, "
                    f"or both equal"
                )
            args.cp_size = cp
            args._check_types("hyper_parallel_cp_size")
        return args

    # --------------------------------------------------------------------------------- checking

    def _fail(self, why: str):
        where = f"hyper_parallel_args {self.source}" if self.source else "hyper_parallel_args"
        raise HyperParallelConfigError(f"hypershard: llamafactory: {where}: {why}")

    def _check_types(self, where: str) -> None:
        for key in ("tp_size", "ep_size", "cp_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self._fail(f"{key}={value!r}; allowed: an integer >= 1")
        if self.dp_size is not None and (
            isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1
        ):
            self._fail(f"dp_size={self.dp_size!r}; allowed: an integer >= 1, or null (the world / (tp x ep))")
        for key in ("fully_shard", "reshard_after_forward", "strict"):
            if not isinstance(getattr(self, key), bool):
                self._fail(f"{key}={getattr(self, key)!r}; allowed: true or false")
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in _DTYPES and not (key == "param_dtype" and value == "auto"):
                extra = '"auto", ' if key == "param_dtype" else ""
                self._fail(f"{key}={value!r}; allowed: null, {extra}or one of {sorted(_DTYPES)}")
        from hypershard.parallel import CP_ALGORITHMS

        if self.recompute not in RECOMPUTE:
            self._fail(f"recompute={self.recompute!r}; allowed: one of {list(RECOMPUTE)}")
        if self.cp_algorithm not in CP_ALGORITHMS:
            self._fail(f"cp_algorithm={self.cp_algorithm!r}; allowed: one of {list(CP_ALGORITHMS)}")
        for key in ("tp_plan", "ep_plan"):
            value = getattr(self, key)
            if not (
                value == "auto"
                or (
                    isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
                )
            ):
                self._fail(
                    f'{key}={value!r}; allowed: "auto" (the model\'s HF plan) or an object '
                    f"{{module pattern: plan style}}"
                )

    def mesh_spec(self, world: int) -> tuple:
        """(shape, names) of the mesh on `world` ranks: dp always (size 1 allowed), ep and tp when > 1."""
        self.check_world(world)
        dp = world // (self.tp_size * self.ep_size * self.cp_size)
        shape, names = [dp], ["dp"]
        for size, name in ((self.cp_size, "cp"), (self.ep_size, "ep"), (self.tp_size, "tp")):
            if size > 1:
                shape.append(size)
                names.append(name)
        return tuple(shape), tuple(names)

    def check_world(self, world: int) -> None:
        if world % self.tp_size:
            self._fail(
                f"tp_size={self.tp_size} does not divide the {world} ranks of this run; allowed: a tp_size "
                f"that divides the world size (torchrun --nproc-per-node)"
            )
        if world % (self.tp_size * self.ep_size):
            self._fail(
                f"tp_size x ep_size = {self.tp_size} x {self.ep_size} does not divide the {world} ranks of "
                f"this run; allowed: sizes whose product divides the world size"
            )
        if world % (self.tp_size * self.ep_size * self.cp_size):
            self._fail(
                f"cp_size x tp_size x ep_size = {self.cp_size} x {self.tp_size} x {self.ep_size} does not divide "
                f"the {world} ranks of this run; allowed: sizes whose product divides the world size"
            )
        dp = world // (self.tp_size * self.ep_size * self.cp_size)
        if self.dp_size is not None and self.dp_size != dp:
            self._fail(
                f"dp_size={self.dp_size} but {world} ranks / (cp_size {self.cp_size} x tp_size {self.tp_size} x "
                f"ep_size {self.ep_size}) = {dp}; allowed: {dp} or null"
            )

    def check_model(self, model: torch.nn.Module) -> None:
        """What the model's shape must allow: heads over tp, experts over ep, a plan to apply."""
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None)
        kv = getattr(text, "num_key_value_heads", None) or heads
        if self.tp_size > 1:
            if heads and self.tp_size > heads:
                self._fail(
                    f"tp_size={self.tp_size} is larger than the model's {heads} attention heads; allowed: "
                    f"a tp_size that divides num_attention_heads={heads}"
                )
            if heads and heads % self.tp_size:
                self._fail(
                    f"tp_size={self.tp_size} does not divide the model's num_attention_heads={heads}; "
                    f"allowed: a divisor of {heads}"
                )
            if kv and kv < self.tp_size and self.tp_size % kv:
                self._fail(
                    f"tp_size={self.tp_size} is neither a divisor nor a multiple of the model's "
                    f"num_key_value_heads={kv}; allowed: one of them"
                )
        if self.ep_size > 1:
            experts = next(
                (
                    getattr(text, k)
                    for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if isinstance(getattr(text, k, None), int)
                ),
                None,
            )
            if experts is None:
                self._fail(
                    f"ep_size={self.ep_size} but the model has no experts (no num_experts in its config); "
                    f"allowed: ep_size 1 for a dense model"
                )
            if experts % self.ep_size:
                self._fail(
                    f"ep_size={self.ep_size} does not divide the model's {experts} experts; allowed: a divisor "
                    f"of {experts}"
                )

    # ------------------------------------------------------------------------------------ use

    def dtype(self, key: str) -> Optional[torch.dtype]:
        value = getattr(self, key)
        return None if value is None or value == "auto" else _DTYPES[value]

    def recompute_mode(self, hf_checkpointing: bool) -> Optional[str]:
        """hs.recompute's mode for this run, or None ("auto": LlamaFactory's own checkpointing, if
        any, is left as it is; "none": nothing recomputed)."""
        return None if self.recompute in ("auto", "none") else self.recompute

    def precision(self, model: torch.nn.Module, training_args=None) -> tuple:
        """(param_dtype, reduce_dtype) of hs.mixed_precision for this run, None where not asked.
        ``param_dtype: "auto"``: a checkpoint stored in bfloat16 (its config's dtype) trains with
        bfloat16 compute from float32 masters and float32 gradient sums -- what LlamaFactory picks on
        a GPU -- unless the YAML's bf16 / fp16 already asks for accelerate's autocast."""
        param, reduce = self.dtype("param_dtype"), self.dtype("reduce_dtype")
        if self.param_dtype == "auto":
            config = getattr(model, "config", None)
            text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
            stored = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
            autocast = training_args is not None and (
                getattr(training_args, "bf16", False) or getattr(training_args, "fp16", False)
            )
            if stored in (torch.bfloat16, "bfloat16") and not autocast:
                param, reduce = torch.bfloat16, reduce or torch.float32
        return param, reduce

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.keys()}
