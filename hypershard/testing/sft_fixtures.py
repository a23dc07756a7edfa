"""Offline fixtures for the SFT tests (hypershard.sft): a tiny byte-level BPE tokenizer with a
ChatML chat template (the layout of Qwen's: <|im_start|>role\\n...<|im_end|>\\n) and small alpaca /
sharegpt datasets. Nothing is downloaded: the tokenizer is trained on the datasets' own text."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "alpaca_records",
    "sharegpt_records",
    "write_tokenizer",
    "write_datasets",
    "write_fixtures",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2's ChatML template without its default system prompt: every message renders the same whatever
# follows it, so the template is prefix-stable (what the label masking needs).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "alpha beta gamma delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue one two three "
    "four five six seven eight nine ten the a of to and is in it"
).split()


def _sentence(i: int, n: int) -> str:
    return " ".join(_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(n))


def alpaca_records(n: int = 24) -> list:
    """`n` alpaca records: some with input, some with a system prompt, some with history."""
    records = []
    for i in range(n):
        rec = {
            "instruction": f"Repeat {_sentence(i, 2 + i % 3)}",
            "input": _sentence(i + 1, i % 4),
            "output": _sentence(i + 2, 3 + i % 5),
        }
        if i % 5 == 0:
            rec["system"] = "You are helpful"
        if i % 6 == 3:
            rec["history"] = [[f"Say {_sentence(i + 3, 2)}", _sentence(i + 4, 2)]]
        records.append(rec)
    return records


def sharegpt_records(n: int = 12) -> list:
    """`n` sharegpt records of one to three human/gpt exchanges, every third with a system turn."""
    records = []
    for i in range(n):
        conv = [{"from": "system", "value": "Answer briefly"}] if i % 3 == 0 else []
        for t in range(1 + i % 3):
            conv.append({"from": "human", "value": f"Echo {_sentence(i + t, 2 + t)}"})
            conv.append({"from": "gpt", "value": _sentence(i + t + 5, 2 + (i + t) % 4)})
        records.append({"conversations": conv})
    return records


def fixture_texts() -> list:
    """The text the fixture tokenizers are trained on: the datasets' records and their system and role words."""
    texts = [json.dumps(r) for r in alpaca_records()] + [json.dumps(r) for r in sharegpt_records()]
    return texts + ["You are helpful", "Answer briefly", "user assistant system"]


def save_byte_level_bpe(
    directory, texts: list, vocab_size: int, special_tokens: list, eos_token: str, chat_template=None
) -> Path:
    """Trains a byte-level BPE (any text encodes) on `texts` and saves it as a transformers tokenizer in
    `directory`: <|endoftext|> pads, `eos_token` ends, the other special tokens are additional ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    pad_token = "<|endoftext|>"
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        additional_special_tokens=[t for t in special_tokens if t not in (eos_token, pad_token)],
    )
    if chat_template is not None:
        wrapped.chat_template = chat_template
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(directory)
    return directory


def write_tokenizer(directory, texts=None, vocab_size: int = 400) -> Path:
    """Trains a byte-level BPE on `texts` (default: the fixtures' datasets) and saves it with the
    ChatML template as a transformers tokenizer in `directory`; <|endoftext|> is eos and pad."""
    if texts is None:
        texts = fixture_texts()
    return save_byte_level_bpe(
        directory, texts, vocab_size, SPECIAL_TOKENS, eos_token="<|endoftext|>", chat_template=CHATML_TEMPLATE
    )


def write_datasets(directory, n_alpaca: int = 24, n_sharegpt: int = 12) -> dict:
    """alpaca.json (a JSON list), alpaca.jsonl (one record a line) and sharegpt.json in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alpaca, sharegpt = alpaca_records(n_alpaca), sharegpt_records(n_sharegpt)
    (directory / "alpaca.json").write_text(json.dumps(alpaca, indent=1))
    (directory / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca))
    (directory / "sharegpt.json").write_text(json.dumps(sharegpt, indent=1))
    return {
        "alpaca": directory / "alpaca.json",
        "alpaca_jsonl": directory / "alpaca.jsonl",
        "sharegpt": directory / "sharegpt.json",
    }


def write_fixtures(directory) -> dict:
    """Tokenizer (in directory/tokenizer) and datasets (in directory); returns their paths."""
    directory = Path(directory)
    paths = write_datasets(directory)
    paths["tokenizer"] = write_tokenizer(directory / "tokenizer")
    return paths
