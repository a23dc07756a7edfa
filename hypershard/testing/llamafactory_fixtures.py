"""Offline fixtures for LlamaFactory runs through hypershard (tests/python/level1/test_llamafactory.py,
docs/llamafactory.md): tiny model folders (config + safetensors + a byte-level BPE tokenizer with
Qwen's special tokens), a LlamaFactory dataset folder (dataset_info.json, alpaca and sharegpt
demo-format files) and the YAML / JSON of a run. Nothing is downloaded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from .sft_fixtures import alpaca_records, fixture_texts, save_byte_level_bpe, sharegpt_records

__all__ = [
    "write_tokenizer",
    "write_model",
    "write_vl_model",
    "write_dataset_dir",
    "write_vl_dataset_dir",
    "write_run",
    "read_losses",
    "read_eval_losses",
    "launch",
]

# Qwen's: <|im_end|> ends a turn (LlamaFactory's qwen3 template makes it the eos), <|endoftext|> pads.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def write_tokenizer(directory, texts: list, vocab_size: int = 320, extra_special: tuple = ()) -> Path:
    """A byte-level BPE (any text encodes: the qwen3 template adds <think> blocks) trained on `texts`."""
    return save_byte_level_bpe(
        directory, texts, vocab_size, SPECIAL_TOKENS + list(extra_special), eos_token="<|im_end|>"
    )


def _texts() -> list:
    return fixture_texts() + ["<think>\n\n</think>\n\n"]


def write_model(directory, model_type: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """A tiny `model_type` (hypershard.testing.models.TINY_CONFIGS) saved with save_pretrained (safetensors),
    its vocabulary the tokenizer's rounded up to a multiple of 8, with the tokenizer beside it."""
    from hypershard.testing.models import tiny_config, tiny_model

    if model_type == "qwen3_vl_moe":
        raise ValueError("write_model: qwen3_vl_moe needs its vision tokens and image processor: write_vl_model")
    directory = Path(directory)
    write_tokenizer(directory, _texts())
    from transformers import AutoTokenizer

    vocab = 8 * math.ceil(len(AutoTokenizer.from_pretrained(str(directory))) / 8)
    values = {"vocab_size": vocab}
    values.update(overrides)
    config = tiny_config(model_type, **values)
    model = tiny_model(config, seed=seed)
    model.config.use_cache = False
    model.save_pretrained(directory)
    return directory


# Qwen-VL's vision tokens: an image is <|vision_start|> <|image_pad|> x (its merged patches) <|vision_end|>.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VL_IMAGE_SIZE = 32  # pixels a side: patch 4 x merge 2 -> an 8 x 8 patch grid, 16 image tokens after the merge


def write_vl_model(directory, seed: int = 0) -> Path:
    """A tiny Qwen3-VL-MoE folder as a published one is laid out: config + safetensors, the
    byte-level tokenizer with Qwen's vision tokens, and preprocessor_config.json for the Qwen2-VL
    image processor (patch / merge sizes the tiny vision tower's; pixel bounds that keep a
    VL_IMAGE_SIZE image at its size). No video processor config: video is out of scope."""
    from transformers import AutoTokenizer

    from hypershard.testing.models import tiny_config, tiny_model

    directory = Path(directory)
    write_tokenizer(directory, _texts(), extra_special=VISION_TOKENS)
    tok = AutoTokenizer.from_pretrained(str(directory))
    ids = {
        name: tok.convert_tokens_to_ids(token)
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS
        )
    }
    vocab = 8 * math.ceil(len(tok) / 8)
    base = tiny_config("qwen3_vl_moe")
    text = dict(base.text_config.to_dict(), vocab_size=vocab, max_position_embeddings=256)
    config = tiny_config("qwen3_vl_moe", text_config=text, **ids)
    model = tiny_model(config, seed=seed)
    model.config.use_cache = False
    model.save_pretrained(directory)
    vision = config.vision_config
    side = VL_IMAGE_SIZE
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "size": {"shortest_edge": 8 * 8, "longest_edge": side * side * 4},
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    return directory


def write_vl_dataset_dir(directory, n: int = 16) -> Path:
    """`n` sharegpt records in LlamaFactory's mllm_demo layout (role/content messages, an `images`
    column), each an instruction about its own small PNG (a colour of its own, a line of dots in one of
    four spacings) and an answer."""
    from PIL import Image

    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    records, texts = [], alpaca_records(n)
    for i in range(n):
        path = directory / "images" / f"{i}.png"
        image = Image.new("RGB", (VL_IMAGE_SIZE, VL_IMAGE_SIZE), ((40 * i) % 256, (90 + 25 * i) % 256, 200))
        for x in range(0, VL_IMAGE_SIZE, 1 + i % 4):
            image.putpixel((x, (x * (i + 1)) % VL_IMAGE_SIZE), (255, 255 - 10 * i % 256, 0))
        image.save(path)
        text = texts[i]
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"<image>{text['instruction']}"},
                    {"role": "assistant", "content": text["output"]},
                ],
                "images": [str(path)],
            }
        )
    (directory / "mllm_demo.json").write_text(json.dumps(records, indent=1))
    info = {
        "mllm_demo": {
            "file_name": "mllm_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        }
    }
    (directory / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return directory


def write_dataset_dir(directory, n_alpaca: int = 16, n_sharegpt: int = 12) -> Path:
    """LlamaFactory's dataset folder: dataset_info.json naming `alpaca_demo` (alpaca format) and
    `sharegpt_demo` (sharegpt format, from/value tags) -- the layouts of its demo datasets."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "alpaca_demo.json").write_text(json.dumps(alpaca_records(n_alpaca), indent=1))
    (directory / "sharegpt_demo.json").write_text(json.dumps(sharegpt_records(n_sharegpt), indent=1))
    info = {
        "alpaca_demo": {"file_name": "alpaca_demo.json"},
        "sharegpt_demo": {"file_name": "sharegpt_demo.json", "formatting": "sharegpt"},
    }
    (directory / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return directory


def write_run(directory, model_dir, dataset_dir, output_dir, *, hp: Optional[dict] = None, **overrides) -> Path:
    """A LlamaFactory training YAML (and, with `hp`, its hyper_parallel_args JSON) in `directory`."""
    import yaml

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(
        model_name_or_path=str(model_dir),
        trust_remote_code=False,
        stage="sft",
        do_train=True,
        finetuning_type="full",
        dataset="alpaca_demo,sharegpt_demo",
        dataset_dir=str(dataset_dir),
        template="qwen3",
        cutoff_len=64,
        overwrite_cache=True,
        preprocessing_num_workers=None,
        output_dir=str(output_dir),
        logging_steps=1,
        save_strategy="no",
        plot_loss=False,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        max_grad_norm=1.0,
        max_steps=4,
        use_cpu=True,
        report_to="none",
        seed=42,
        dataloader_num_workers=0,
        bf16=False,
        disable_tqdm=True,
    )
    config.update(overrides)
    if hp is not None:
        hp_path = directory / "hyper_parallel.json"
        hp_path.write_text(json.dumps(hp, indent=1))
        config.update(use_hyper_parallel=True, hyper_parallel_args=str(hp_path))
    path = directory / "train.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def read_eval_losses(output_dir) -> dict:
    """{step: eval_loss} of a finished run (trainer_state.json's log_history)."""
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["eval_loss"] for entry in history if "eval_loss" in entry}


def read_losses(output_dir) -> dict:
    """{step: loss} from HF's trainer_state.json (log_history) of a finished run, or from the
    newest checkpoint's when the run was cut short."""
    output_dir = Path(output_dir)
    state = output_dir / "trainer_state.json"
    if not state.is_file():
        checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        state = checkpoints[-1] / "trainer_state.json"
    history = json.loads(state.read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def launch(yaml_path, nproc: int, env: Optional[dict] = None, timeout: int = 300):
    """LlamaFactory through hypershard's launcher: under torchrun (each line tagged with its rank by
    --tee) for nproc > 1, one process otherwise. Each rank's watchdog (HYPERSHARD_LLAMAFACTORY_TIMEOUT)
    fires after `timeout` s and names itself; the launch is killed 60 s later (subprocess.TimeoutExpired)."""
    import os
    import subprocess
    import sys

    head = [sys.executable]
    if nproc > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--tee=3"]
    command = [*head, "-m", "hypershard.integrations.llamafactory", "train", str(yaml_path)]
    full_env = {**os.environ, "HYPERSHARD_LLAMAFACTORY_TIMEOUT": str(timeout), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60, env=full_env)
