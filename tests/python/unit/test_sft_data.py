"""hypershard.sft without processes: LlamaFactory's alpaca / sharegpt records -> chat messages ->
token ids and labels (masks checked by decoding the trained tokens), truncation, padded batches,
the data order, micro-batches, the learning-rate schedule, gradient accumulation on one device,
model building and the up-front errors of the command line."""

import json
import math

import pytest
import torch

from hypershard.sft import data as D
from hypershard.sft.data import IGNORE, SFTError
from hypershard.testing.sft_fixtures import CHATML_TEMPLATE, write_fixtures


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return write_fixtures(tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="module")
def tokenizer(fixtures):
    from hypershard.sft.train import load_tokenizer

    return load_tokenizer(fixtures["tokenizer"])


def trained_segments(labels):
    """The runs of consecutive trained label ids."""
    runs, current = [], []
    for label in labels:
        if label == IGNORE:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(label)
    return runs + ([current] if current else [])


# ------------------------------------------------------------------------------ files and formats

def test_load_json_list_and_jsonl_give_the_same_records(fixtures):
    assert D.load_records(fixtures["alpaca"]) == D.load_records(fixtures["alpaca_jsonl"])
    assert len(D.load_records(fixtures["sharegpt"])) == 12


@pytest.mark.parametrize("text, problem", [
    ("[]", "holds no list of JSON objects"),
    ('[1, 2]', "holds no list of JSON objects"),
    ('{"instruction": "a", "output": "b"}\nnot json\n', "line 2 is not JSON"),
])
def test_bad_files_are_refused(tmp_path, text, problem):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SFTError, match=problem) as err:
        D.load_records(path)
    assert str(err.value).startswith("hypershard: sft: ") and "; allowed: " in str(err.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(SFTError, match="does not exist"):
        D.load_records(tmp_path / "nope.json")


def test_format_detection(fixtures):
    assert D.detect_format(D.load_records(fixtures["alpaca"])) == "alpaca"
    assert D.detect_format(D.load_records(fixtures["sharegpt"])) == "sharegpt"
    assert D.detect_format([{"messages": []}]) == "sharegpt"
    with pytest.raises(SFTError, match=r"cannot detect the format .*; allowed: alpaca"):
        D.detect_format([{"prompt": "x"}])
    with pytest.raises(SFTError, match="--format 'llama'"):
        D.to_messages([{"instruction": "a", "output": "b"}], "llama")


def test_alpaca_messages():
    rec = {"instruction": "Do it", "input": "on this", "output": "done", "system": "sys",
           "history": [["q1", "a1"]]}
    assert D.alpaca_messages(rec) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "Do it\non this"},
        {"role": "assistant", "content": "done"}]
    # An empty input adds nothing (no trailing newline).
    assert D.alpaca_messages({"instruction": "Do it", "input": "", "output": "x"})[0]["content"] == "Do it"
    with pytest.raises(SFTError, match="alpaca record 3 has no 'output'"):
        D.alpaca_messages({"instruction": "a"}, 3)


def test_sharegpt_messages_both_spellings():
    conv = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                              {"from": "gpt", "value": "a"}]}
    msgs = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}
    assert D.sharegpt_messages(conv) == D.sharegpt_messages(msgs) == msgs["messages"]


@pytest.mark.parametrize("turns, problem", [
    ([{"from": "robot", "value": "q"}], "has role 'robot'"),
    ([{"from": "gpt", "value": "a"}], "turn 0 has role 'assistant' where 'user' belongs"),
    ([{"from": "human", "value": "q"}, {"from": "human", "value": "q"}],
     "turn 1 has role 'user' where 'assistant' belongs"),
    ([{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}],
     "does not end with an assistant turn"),
    ([{"from": "human", "value": 3}], "is int, not a string"),
])
def test_bad_sharegpt_records_are_refused(turns, problem):
    with pytest.raises(SFTError, match=problem):
        D.to_messages([{"conversations": turns}], "sharegpt")


# ------------------------------------------------------------------------------ tokens and labels

def test_single_turn_masks_exactly_the_prompt(tokenizer):
    messages = [{"role": "system", "content": "You are helpful"}, {"role": "user", "content": "Echo alpha"},
                {"role": "assistant", "content": "beta gamma"}]
    ids, labels = D.encode(messages, tokenizer)
    assert len(ids) == len(labels)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    # Labels are the ids where trained, IGNORE elsewhere.
    assert all(lab in (IGNORE, i) for i, lab in zip(ids, labels))
    (answer,) = trained_segments(labels)
    assert tokenizer.decode(answer) == "beta gamma<|im_end|>\n"
    prompt = [i for i, lab in zip(ids, labels) if lab == IGNORE]
    assert tokenizer.decode(prompt) == ("<|im_start|>system\nYou are helpful<|im_end|>\n"
                                        "<|im_start|>user\nEcho alpha<|im_end|>\n<|im_start|>assistant\n")


def test_multi_turn_trains_every_assistant_turn(tokenizer):
    messages = D.sharegpt_messages({"conversations": [
        {"from": "human", "value": "one"}, {"from": "gpt", "value": "alpha"},
        {"from": "human", "value": "two"}, {"from": "gpt", "value": "beta beta"},
        {"from": "human", "value": "three"}, {"from": "gpt", "value": "gamma"}]})
    ids, labels = D.encode(messages, tokenizer)
    assert [tokenizer.decode(s) for s in trained_segments(labels)] == [
        "alpha<|im_end|>\n", "beta beta<|im_end|>\n", "gamma<|im_end|>\n"]
    assert tokenizer.decode(ids) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_every_fixture_record_encodes_with_answers_trained(fixtures, tokenizer):
    for name in ("alpaca", "sharegpt"):
        conversations = D.to_messages(D.load_records(fixtures[name]))
        for messages, (ids, labels) in zip(conversations, D.encode_all(conversations, tokenizer)):
            answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
            assert [tokenizer.decode(s) for s in trained_segments(labels)] == answers


def test_truncation(tokenizer):
    messages = [{"role": "user", "content": "Echo alpha"}, {"role": "assistant", "content": "beta gamma delta"}]
    ids, labels = D.encode(messages, tokenizer)
    short_ids, short_labels = D.encode(messages, tokenizer, cutoff_len=len(ids) - 3)
    assert short_ids == ids[:-3] and short_labels == labels[:-3]


def test_template_that_is_not_prefix_stable_is_refused(tokenizer):
    # Renders the message count first: a prefix renders differently once more messages follow.
    unstable = "{{ messages|length }}" + CHATML_TEMPLATE
    saved = tokenizer.chat_template
    tokenizer.chat_template = unstable
    try:
        with pytest.raises(SFTError, match="not prefix-stable at message 1"):
            D.encode([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tokenizer)
        tokenizer.chat_template = None
        with pytest.raises(SFTError, match="has no chat_template"):
            D.encode([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], tokenizer)
    finally:
        tokenizer.chat_template = saved


def test_collate_pads_right_with_masks():
    batch = D.collate([([5, 6, 7], [IGNORE, 6, 7]), ([8], [IGNORE])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [IGNORE, IGNORE, IGNORE]]
    # HF's causal loss shifts labels by one, so the label at position 0 is never counted.
    assert D.trained_tokens(batch["labels"]) == 2
    assert D.trained_tokens(torch.tensor([[4, 5, IGNORE]])) == 1


def test_collate_pads_to_a_multiple_for_context_parallelism():
    batch = D.collate([([5, 6, 7], [IGNORE, 6, 7]), ([8], [IGNORE])], pad_id=0, multiple=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7, IGNORE], [IGNORE] * 4]
    assert D.collate([([5] * 8, [5] * 8)], pad_id=0, multiple=4)["input_ids"].shape == (1, 8)  # no extra chunk


# ------------------------------------------------------------------------------ order and batches

def test_batch_size_checks():
    D.check_batch_sizes(8, 4, 2, 20)
    with pytest.raises(SFTError, match="--micro-batch-size 3 does not divide --batch-size 8"):
        D.check_batch_sizes(8, 3, 1, 20)
    with pytest.raises(SFTError, match=r"--micro-batch-size 2 is not divisible by the mesh's dp size 4.*"
                                       r"allowed: a multiple of 4"):
        D.check_batch_sizes(8, 2, 4, 20)
    with pytest.raises(SFTError, match="the data has 5 examples, fewer than one --batch-size 8"):
        D.check_batch_sizes(8, 8, 1, 5)


def test_data_order_is_deterministic_per_epoch():
    assert D.epoch_order(10, 42, 0) == D.epoch_order(10, 42, 0)
    assert sorted(D.epoch_order(10, 42, 1)) == list(range(10))
    assert D.epoch_order(10, 42, 0) != D.epoch_order(10, 42, 1)
    # 10 examples, batches of 4: two batches an epoch (the last 2 examples dropped), then epoch 1.
    epoch0 = D.epoch_order(10, 42, 0)
    assert D.global_batch(10, 4, 42, 1) == (0, 1, epoch0[4:8])
    assert D.global_batch(10, 4, 42, 2) == (1, 0, D.epoch_order(10, 42, 1)[:4])
    assert D.micro_batches([1, 2, 3, 4, 5, 6], 2) == [[1, 2], [3, 4], [5, 6]]


def test_lr_schedule():
    # Warmup: linear from 0 (HF's convention: step 0 of a warmup has lr 0).
    assert [D.lr_factor(s, 10, 4) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    # Cosine from 1 at the end of warmup to min_ratio at `total`, halfway at the middle.
    assert D.lr_factor(7, 10, 4, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert D.lr_factor(10, 10, 4, 0.1) == pytest.approx(0.1)
    assert D.lr_factor(0, 10, 0) == 1.0
    assert D.warmup_steps(10, ratio=0.25) == 3 and D.warmup_steps(10, steps=2) == 2
    with pytest.raises(SFTError, match="both --warmup-steps 2 and --warmup-ratio 0.5"):
        D.warmup_steps(10, 2, 0.5)


# ------------------------------------------------------------------------------ training pieces

def test_accumulation_gives_the_gradient_of_one_large_batch(fixtures, tokenizer):
    """Four sequences in one forward vs four micro-batches of one: each micro-batch loss is divided by
    the whole batch's trained tokens (num_items_in_batch), so the summed losses and the accumulated
    gradients agree. Only the summation order differs (per-micro-batch sums, padding to another width
    changes no real token's value), a few float32 ulps: rtol 1e-5 with a small atol for the elements
    that nearly cancel."""
    from hypershard.sft.train import accumulate, build_model

    conversations = D.to_messages(D.load_records(fixtures["alpaca"]))[:4]
    examples = D.encode_all(conversations, tokenizer)
    results = []
    for micro in (4, 1):
        model = build_model("qwen3", len(tokenizer), seed=0, cutoff_len=64)
        batches = [D.collate([examples[i] for i in mb], tokenizer.pad_token_id)
                   for mb in D.micro_batches(list(range(4)), micro)]
        n_items = sum(D.trained_tokens(b["labels"]) for b in batches)
        loss = accumulate(model, batches, n_items)
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (big_loss, big), (acc_loss, acc) = results
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-5, atol=1e-6, msg=name)


def test_build_model_from_type_and_directory(tmp_path, tokenizer):
    from hypershard.sft.train import build_model

    model = build_model("qwen3", len(tokenizer), seed=0, cutoff_len=128)
    assert model.config.vocab_size == 8 * math.ceil(len(tokenizer) / 8)
    assert model.config.max_position_embeddings == 128
    model.save_pretrained(tmp_path / "m")
    again = build_model(str(tmp_path / "m"), len(tokenizer), seed=0, cutoff_len=128)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(SFTError, match="fewer than the tokenizer's 100000 tokens"):
        build_model(str(tmp_path / "m"), 100000, seed=0, cutoff_len=128)
    with pytest.raises(SFTError, match="--model 'gpt9' is neither a directory nor a tiny model type"):
        build_model("gpt9", 100, seed=0, cutoff_len=128)


def test_command_line_errors_before_any_rank_starts(fixtures, tmp_path, capsys):
    from hypershard.sft.cli import main

    base = ["--model", "qwen3", "--tokenizer", str(fixtures["tokenizer"]), "--data", str(fixtures["alpaca"]),
            "--output", str(tmp_path / "out")]
    assert main(base + ["--mesh", "dp=4", "--batch-size", "4", "--micro-batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "hypershard: sft: --micro-batch-size 2 is not divisible by the mesh's dp size 4" in err
    assert main(base[:-4] + ["--data", str(tmp_path / "none.json"), "--output", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(base + ["--tokenizer", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "out" / "checkpoints" / "step_00000001").mkdir(parents=True)
    assert main(base + ["--batch-size", "4"]) == 2
    assert "already holds checkpoints; allowed: --resume" in capsys.readouterr().err
    records = json.loads(fixtures["alpaca"].read_text())
    assert len(records) == 24


def test_context_parallel_takes_several_sequences_per_dp_rank(fixtures, tmp_path):
    """On dp=2 x cp=2 the micro-batch defaults to the whole batch as on any mesh (4 sequences per dp
    rank here), and the checks before any rank starts accept it: parallelize's loss keeps the
    batch and sequence dims apart, so no flatten cuts through the cp shards."""
    from hypershard.sft.cli import parse_args, preflight

    args = parse_args(["--model", "qwen3", "--tokenizer", str(fixtures["tokenizer"]), "--data",
                       str(fixtures["alpaca"]), "--output", str(tmp_path / "out"), "--mesh", "dp=2,cp=2",
                       "--batch-size", "8"])
    assert args.micro_batch_size == 8
    preflight(args)


def test_run_length_and_warmup():
    from types import SimpleNamespace

    from hypershard.sft.train import schedule

    args = SimpleNamespace(batch_size=4, max_steps=0, epochs=2, warmup_steps=0, warmup_ratio=0.1)
    assert schedule(args, 26) == (6, 12, 2)  # 6 full batches an epoch (2 examples dropped), 2 epochs
    args.max_steps = 5
    assert schedule(args, 26) == (6, 5, 1)
    args.max_steps, args.epochs = 0, 0
    with pytest.raises(SFTError, match="0 training steps"):
        schedule(args, 26)


def test_resume_restores_the_schedule_and_refuses_changed_arguments(monkeypatch, tmp_path):
    """The resume logic against a stand-in for hypershard.checkpoint (its own tests cover save/load)."""
    from types import SimpleNamespace

    from hypershard import checkpoint
    from hypershard.sft import train as T

    args = SimpleNamespace(output=str(tmp_path), **{k: 1 for k in T.RESUME_MUST_MATCH})
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    extra = {"step": 3, "losses": [{"step": s} for s in (1, 2, 3)], "scheduler": scheduler.state_dict(),
             "args": {k: 1 for k in T.RESUME_MUST_MATCH}}

    def stand_in(name, fn):  # the package's name and the one its own functions call (checkpoint/api.py)
        monkeypatch.setattr(checkpoint, name, fn)
        monkeypatch.setattr(checkpoint.api, name, fn)

    stand_in("latest", lambda directory: None)
    with pytest.raises(SFTError, match="--resume: no complete checkpoint in"):
        T._resume(args, model, optimizer, scheduler)
    stand_in("latest", lambda directory: tmp_path / "step_00000003")
    stand_in("load", lambda path, m, o: extra)
    stand_in("read_extra", lambda path: extra)
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 0.5 ** s)
    step, records, path = T._resume(args, model, fresh, fresh_scheduler)
    assert (step, len(records), path.name) == (3, 3, "step_00000003")
    assert fresh.param_groups[0]["lr"] == fresh_scheduler.get_last_lr()[0] == 0.125
    args.batch_size = 8
    with pytest.raises(SFTError, match="written with batch_size=1, this run has 8; allowed: the checkpoint's"):
        T._resume(args, model, fresh, fresh_scheduler)
