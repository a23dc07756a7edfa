"""python -m hypershard.testing.fixtures --out DIR: the tiny inputs the documented commands need, made
offline (nothing is downloaded; this machine has no hub).

Writes, under DIR:
- ``models/<family>/``: a tiny model folder per target family (config.json + model.safetensors + a
  byte-level BPE tokenizer with Qwen's special tokens): qwen3, qwen3_5_text, qwen3_5_moe_text,
  deepseek_v32 and qwen3_vl_moe (with its vision tokens and image processor). Each serves as
  ``hypershard.sft --model``, ``hs.from_pretrained`` and LlamaFactory's ``model_name_or_path``;
- ``sft/``: hypershard.sft's data (alpaca.json, alpaca.jsonl, sharegpt.json);
- ``llamafactory_data/``: LlamaFactory's dataset folder (dataset_info.json naming ``alpaca_demo``
  and ``sharegpt_demo``, and ``mllm_demo`` with images for the vision-language model).

Random weights: the files are for trying the commands, not for their losses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FAMILIES = ("qwen3", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v32", "qwen3_vl_moe")


def _add_chat_template(model_dir: Path) -> None:
    """Qwen's ChatML template in the folder's tokenizer_config.json: hypershard.sft applies the
    tokenizer's own template (LlamaFactory applies its `template:` and ignores it)."""
    from .sft_fixtures import CHATML_TEMPLATE

    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHATML_TEMPLATE
    path.write_text(json.dumps(config, indent=2))


def write_all(out, families=FAMILIES) -> dict:
    """Writes the fixtures (module docstring) under `out`; returns {name: path}."""
    from .llamafactory_fixtures import write_dataset_dir, write_model, write_vl_dataset_dir, write_vl_model
    from .sft_fixtures import write_datasets

    out = Path(out)
    paths = {}
    for family in families:
        target = out / "models" / family
        paths[f"model {family}"] = write_vl_model(target) if family == "qwen3_vl_moe" else write_model(target, family)
        _add_chat_template(target)
    for name, path in write_datasets(out / "sft").items():
        paths[f"sft {name}"] = path
    data = write_dataset_dir(out / "llamafactory_data")
    if "qwen3_vl_moe" in families:  # its writer names only mllm_demo in dataset_info.json: merge the two
        info = json.loads((data / "dataset_info.json").read_text())
        write_vl_dataset_dir(data)
        info.update(json.loads((data / "dataset_info.json").read_text()))
        (data / "dataset_info.json").write_text(json.dumps(info, indent=1))
    paths["llamafactory dataset_dir"] = data
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hypershard.testing.fixtures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write into (created; existing files are replaced)")
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated model families to write (default all: {', '.join(FAMILIES)})",
    )
    args = parser.parse_args(argv)
    families = tuple(f for f in args.families.split(",") if f)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        print(f"hypershard: fixtures: unknown families {unknown}; allowed: {list(FAMILIES)}", file=sys.stderr)
        return 2
    for name, path in write_all(args.out, families).items():
        print(f"{name:<28} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
