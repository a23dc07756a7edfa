"""SFT data: LlamaFactory's alpaca and sharegpt formats -> chat messages -> token ids with labels
(-100 on every prompt token), padded micro-batches, the data order and the learning-rate schedule.
Pure functions of their arguments (no processes, no mesh), so tests/python/unit covers them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

IGNORE = -100  # the label of a token that is not trained (HF's ignore_index)
FORMATS = ("alpaca", "sharegpt", "auto")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class SFTError(ValueError):
    """A bad argument, file or record; its message is one line in the project's error format."""


def fail(problem: str, allowed: str):
    raise SFTError(f"hypershard: sft: {problem}; allowed: {allowed}")


# ------------------------------------------------------------------------------ files and formats


def load_records(path) -> list:
    """The records of a JSON file holding a list of objects, or of a JSONL file (one object a line)."""
    path = Path(path)
    if not path.is_file():
        fail(f"data file {str(path)!r} does not exist", "a .json list or a .jsonl file of records")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data.append(json.loads(line))
            except json.JSONDecodeError as e:
                fail(
                    f"data file {str(path)!r} line {number} is not JSON ({e.msg})",
                    "a .json list or a .jsonl file of records",
                )
    if isinstance(data, dict):
        data = [data]  # a JSONL file of one record parses as one object
    if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
        fail(f"data file {str(path)!r} holds no list of JSON objects", "a non-empty list of records")
    return data


def detect_format(records: list) -> str:
    """'alpaca' when the first record has an instruction, 'sharegpt' when it has conversations or messages."""
    first = records[0]
    if "conversations" in first or "messages" in first:
        return "sharegpt"
    if "instruction" in first:
        return "alpaca"
    fail(
        f"cannot detect the format of a record with keys {sorted(first)}",
        "alpaca (instruction, input, output) or sharegpt (conversations or messages)",
    )


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        fail(f"{where} is {type(value).__name__}, not a string", "strings")
    return value


def alpaca_messages(record: dict, index: int = 0) -> list:
    """[system], history turns, then user = instruction (+ "\\n" + input when non-empty), assistant = output."""
    where = f"alpaca record {index}"
    for key in ("instruction", "output"):
        if key not in record:
            fail(f"{where} has no {key!r} (keys {sorted(record)})", "instruction, input, output, system, history")
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], f"{where} system")})
    for turn in record.get("history") or []:
        if not isinstance(turn, (list, tuple)) or len(turn) != 2:
            fail(f"{where} history entry {turn!r} is not a [query, answer] pair", "[[query, answer], ...]")
        messages.append({"role": "user", "content": _text(turn[0], f"{where} history query")})
        messages.append({"role": "assistant", "content": _text(turn[1], f"{where} history answer")})
    user = _text(record["instruction"], f"{where} instruction")
    extra = _text(record.get("input") or "", f"{where} input")
    if extra:
        user = f"{user}\n{extra}"
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": _text(record["output"], f"{where} output")})
    return messages


def sharegpt_messages(record: dict, index: int = 0) -> list:
    """conversations [{"from", "value"}] or messages [{"role", "content"}]: an optional system turn, then
    user / assistant turns alternating, starting with user and ending with assistant."""
    where = f"sharegpt record {index}"
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        fail(f"{where} has no list of turns (keys {sorted(record)})", "conversations or messages: a list of turns")
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], f"{where} system")})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            fail(f"{where} turn {i} is {type(turn).__name__}", "objects with from/value or role/content")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role not in _SHAREGPT_ROLES:
            fail(f"{where} turn {i} has role {role!r}", str(sorted(_SHAREGPT_ROLES)))
        messages.append({"role": _SHAREGPT_ROLES[role], "content": _text(content, f"{where} turn {i} text")})
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for i, message in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            fail(
                f"{where} turn {i} has role {message['role']!r} where {expected!r} belongs",
                "[system], then user/assistant alternating, ending with assistant",
            )
    if not body or body[-1]["role"] != "assistant":
        fail(
            f"{where} does not end with an assistant turn",
            "[system], then user/assistant alternating, ending with assistant",
        )
    return messages


def to_messages(records: list, fmt: str = "auto") -> list:
    """Every record's chat messages ([{"role", "content"}, ...]) in `fmt` (auto: detected from record 0)."""
    if fmt not in FORMATS:
        fail(f"--format {fmt!r}", ", ".join(FORMATS))
    if fmt == "auto":
        fmt = detect_format(records)
    convert = alpaca_messages if fmt == "alpaca" else sharegpt_messages
    return [convert(r, i) for i, r in enumerate(records)]


# ------------------------------------------------------------------------------ tokens and labels


def _template(tokenizer, messages: list, generation_prompt: bool) -> list:
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(ids)


def encode(messages: list, tokenizer, cutoff_len: Optional[int] = None) -> tuple:
    """(input_ids, labels) of one conversation through the tokenizer's chat template. Each assistant
    turn's tokens (its answer and the template's end of turn) keep their ids as labels; every other
    token (system, user turns, the scaffolding before each answer) is IGNORE. The boundaries come
    from rendering message prefixes, so the template must render a prefix the same whatever follows."""
    if getattr(tokenizer, "chat_template", None) is None:
        fail("the tokenizer has no chat_template", "a tokenizer whose tokenizer_config.json has one")
    ids: list = []
    labels: list = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _template(tokenizer, messages[:i], generation_prompt=True)
        full = _template(tokenizer, messages[: i + 1], generation_prompt=False)
        if prompt[: len(ids)] != ids or full[: len(prompt)] != prompt:
            fail(
                f"the chat template is not prefix-stable at message {i}: rendering the conversation up to "
                "an assistant turn changes the tokens rendered before it (e.g. a template that drops "
                "earlier turns' reasoning)",
                "a template under which each prefix renders the same",
            )
        labels += [IGNORE] * (len(prompt) - len(ids)) + full[len(prompt) :]
        ids = full
    if cutoff_len is not None:
        ids, labels = ids[:cutoff_len], labels[:cutoff_len]
    return ids, labels


def encode_all(conversations: list, tokenizer, cutoff_len: Optional[int] = None) -> list:
    return [encode(m, tokenizer, cutoff_len) for m in conversations]


def trained_tokens(labels: torch.Tensor) -> int:
    """Tokens whose loss is counted: HF's causal loss shifts labels by one, so position 0 never is."""
    return int((labels[..., 1:] != IGNORE).sum())


def collate(examples: list, pad_id: int, multiple: int = 1) -> dict:
    """Pads (input_ids, labels) examples on the right to the longest, rounded up to `multiple`
    (context parallelism stores a sequence as 2 x cp equal chunks): input_ids `pad_id`,
    attention_mask 0 and labels IGNORE on the padding."""
    width = -(-max(len(ids) for ids, _ in examples) // multiple) * multiple
    n = len(examples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


# ------------------------------------------------------------------------------ order and batches


def check_batch_sizes(batch_size: int, micro_batch_size: int, dp: int, n_examples: int) -> None:
    """Up-front checks: micro-batches divide the global batch, dp divides a micro-batch, one batch
    fits. Context parallelism puts no limit on the sequences per dp rank (parallelize's loss keeps
    the batch and sequence dims apart)."""
    if batch_size < 1 or micro_batch_size < 1:
        fail(f"--batch-size {batch_size} / --micro-batch-size {micro_batch_size}", "positive integers")
    if batch_size % micro_batch_size:
        fail(
            f"--micro-batch-size {micro_batch_size} does not divide --batch-size {batch_size}",
            f"a divisor of {batch_size}",
        )
    if micro_batch_size % dp:
        fail(
            f"--micro-batch-size {micro_batch_size} is not divisible by the mesh's dp size {dp} (each "
            "micro-batch is split over dp)",
            f"a multiple of {dp}",
        )
    if n_examples < batch_size:
        fail(
            f"the data has {n_examples} examples, fewer than one --batch-size {batch_size}",
            f"--batch-size <= {n_examples}",
        )


def epoch_order(n_examples: int, seed: int, epoch: int) -> list:
    """The example order of `epoch`: a permutation drawn from seed + epoch (the same on every rank)."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n_examples, generator=g).tolist()


def global_batch(n_examples: int, batch_size: int, seed: int, step: int) -> tuple:
    """(epoch, index in the epoch, example indices) of 0-based `step`; the last incomplete batch of an
    epoch is dropped (so every step has batch_size examples and dp divides every micro-batch)."""
    per_epoch = n_examples // batch_size
    epoch, index = divmod(step, per_epoch)
    order = epoch_order(n_examples, seed, epoch)
    return epoch, index, order[index * batch_size : (index + 1) * batch_size]


def micro_batches(indices: list, micro_batch_size: int) -> list:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


# ------------------------------------------------------------------------------ learning rate


def lr_factor(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    """HF's cosine schedule with warmup and a floor (get_cosine_with_min_lr_schedule_with_warmup):
    step/warmup while warming up (so step 0 has lr 0 when warmup > 0), then a half cosine from 1 down
    to min_ratio at `total`."""
    if step < warmup:
        return step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps(total: int, steps: int = 0, ratio: float = 0.0) -> int:
    if steps and ratio:
        fail(f"both --warmup-steps {steps} and --warmup-ratio {ratio}", "one of them")
    if steps < 0 or not 0.0 <= ratio <= 1.0:
        fail(f"--warmup-steps {steps} / --warmup-ratio {ratio}", "steps >= 0, a ratio in [0, 1]")
    return steps if steps else math.ceil(ratio * total)
