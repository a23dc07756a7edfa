"""Level1, strict mode: checkpoints that reshard across pp sizes (issue 46). Qwen3 (4 layers) trains
2 AdamW steps on one mesh, hypershard.checkpoint.save writes model and optimizer, a fresh model on
ANOTHER mesh loads it and trains step 3; the 3 losses and the final parameters must equal 3
uninterrupted one-device steps within hypershard.testing.training's tolerances (the first step's
gradients are compared on the parameters the first mesh's rank holds).

- pp2 x dp2 (1F1B, 4 microbatches) -> dp2 x tp2 (hs.parallelize): each pp rank writes its stage's
  slice of the model and optimizer under the full model's names (a stage is a pruned copy of the
  model), checked against the checkpoint's metadata: every one of the full model's keys, once.
- dp2 x tp2 -> pp2 x dp2: each stage reads its slice of the saved tp shards.

Planted fault: the resume skips loading stage 1's parameters (layers 2-3, norm, lm_head keep their
initial values; their optimizer state is loaded) -- the checks must fail."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS, SAVED_AT = 3, 2
BATCH, MICROBATCHES = 8, 4
CONFIG = {"num_hidden_layers": 4}
PP2_DP2 = ((2, 2), ("pp", "dp"))
STAGE_1 = ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")


def _setup():
    from hypershard.testing.models import make_batches, tiny_config

    config = tiny_config("qwen3", **CONFIG)
    return config, make_batches(config.vocab_size, STEPS, batch=BATCH, seq=16)


class _Run:
    """A model on one of the two meshes with models.train's loop (AdamW lr 1e-3, weight decay 0.01,
    clip_grad_norm_ 1.0): `pp` is hs.pipeline on pp2 x dp2, `tp` hs.parallelize on dp2 x tp2."""

    def __init__(self, kind, config, seed):
        import hypershard as hs
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model

        self.kind = kind
        model = tiny_model(config, seed=seed)
        if kind == "pp":
            self.model = hs.pipeline(model, current_mesh(), n_microbatches=MICROBATCHES, schedule="1f1b")
        else:
            self.model = parallelize(model, hs.init_device_mesh("cpu", (2, 2), ("dp", "tp")))
        self.params = [p for _, p in self.model.named_parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01)

    def step(self, ids, labels, grads=None):
        from hypershard.testing.training import _full

        self.optimizer.zero_grad()
        if self.kind == "pp":
            loss = self.model.step(ids, labels)
        else:
            out = self.model(input_ids=ids, labels=labels).loss
            out.backward()
            loss = float(out.detach().item())
        if grads is not None:
            grads.update({n: _full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None})
        if self.kind == "pp":
            self.model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        return loss


def _shared_dir():
    import tempfile

    import torch.distributed as dist

    holder = [tempfile.mkdtemp(prefix="hs_pp_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _skip_stage_1_parameters(checkpoint_api):
    """The fault: load's model state dict without stage 1's parameters."""
    original = checkpoint_api.model_state_dict

    def state_dict(model):
        return {k: v for k, v in original(model).items() if not k.startswith(STAGE_1)}

    checkpoint_api.model_state_dict = state_dict
    return original


def trainer(first, then, fault=False):
    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train

        config, batches = _setup()
        return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)

    def distributed(_dummy):
        import shutil

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        import hypershard as hs
        from hypershard import checkpoint
        from hypershard.checkpoint import api as checkpoint_api
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import TrainingRecord, _full, check_training, record_training

        assert hs.is_strict()
        config, batches = _setup()
        expected = record_training(tiny_model(config), batches)
        root = _shared_dir()
        try:
            run = _Run(first, config, seed=0)
            grads: dict = {}
            losses = [run.step(*batches[0], grads=grads), run.step(*batches[1])]
            path = checkpoint.save(root, run.model, run.optimizer, step=SAVED_AT, extra={"losses": losses})
            saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            model_keys = {k[len("model.") :] for k in saved if k.startswith("model.")}
            full_keys = set(tiny_model(config).state_dict())
            assert model_keys == full_keys, f"saved model keys differ: {sorted(model_keys ^ full_keys)[:8]}"
            optimizer_names = {k[len("optimizer.state.") :].rsplit(".", 1)[0] for k in saved if "optimizer.state." in k}
            assert optimizer_names == {n for n, _ in tiny_model(config).named_parameters()}, "optimizer state keys"
            del run

            resumed = _Run(then, config, seed=1)  # other weights: the load must fill every one
            original = _skip_stage_1_parameters(checkpoint_api) if fault else None
            try:
                extra = checkpoint.load(root, resumed.model, resumed.optimizer)
            finally:
                if original is not None:
                    checkpoint_api.model_state_dict = original
            assert extra["losses"] == losses
            losses.append(resumed.step(*batches[2]))
            got = TrainingRecord(
                losses=losses,
                first_grads=grads,
                final={n: _full(p) for n, p in resumed.model.named_parameters()},
            )
            # the parameters this rank holds on each mesh (a pipeline rank: its stage's)
            expected.first_grads = {n: g for n, g in expected.first_grads.items() if n in grads}
            expected.final = {n: t for n, t in expected.final.items() if n in got.final}
            problems, worst = check_training(got, expected)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
        if fault:
            _report(first, then + " (planted fault)", expected.losses, losses, {"problems": problems[:3]})
            assert problems, f"planted fault was NOT caught; worst ratios {worst}"
            return torch.tensor(expected.losses, dtype=torch.float64)
        assert not problems, "\n".join(problems)
        _report(first, then, expected.losses, losses, worst)
        return torch.tensor(losses, dtype=torch.float64)

    return reference, distributed


def _report(first, then, expected, got, worst):
    """With HYPERSHARD_PP_REPORT=FILE, rank 0 appends the loss table of the case to FILE."""
    import json
    import os

    import torch.distributed as dist

    path = os.environ.get("HYPERSHARD_PP_REPORT")
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            record = {"saved_on": first, "resumed_on": then, "one_device": expected, "resumed": got, "worst": worst}
            f.write(json.dumps(record) + "\n")


def _case(name, reference, distributed):
    return Case(
        name,
        reference,
        [Input((1,), requires_grad=False)],
        PP2_DP2,
        dist_fn=distributed,
        check_grad=False,
        rtol=1e-5,
        atol=0.0,
    )


def test_qwen3_pp2_dp2_checkpoint_resumes_on_dp2_tp2_strict():
    cases = [
        _case("qwen3_pp2_dp2_to_dp2_tp2", *trainer("pp", "tp")),
        _case("qwen3_dp2_tp2_to_pp2_dp2", *trainer("tp", "pp")),
        _case("qwen3_pp2_to_tp2_planted_skip_stage_1_is_caught", *trainer("pp", "tp", fault=True)),
    ]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=400))


def from_pretrained_trainer(fully_shard=False):
    """hs.from_pretrained on pp2 x dp2: each rank reads only its stage's tensors (the other stage's
    keys are its unused ones), equal bit for bit to the saved model, then trains like one device.
    With fully_shard=True each stage's layers and root are fully sharded over dp on meta, so a rank
    reads exactly half its stage's bytes (every dim 0 of the tiny Qwen3 is even)."""

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train

        config, batches = _setup()
        return torch.tensor(train(tiny_model(config), batches), dtype=torch.float64)

    def distributed(_dummy):
        import shutil

        import torch.distributed as dist

        import hypershard as hs
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import _full, check_training, record_training

        config, batches = _setup()
        expected = record_training(tiny_model(config), batches)
        root = _shared_dir()
        try:
            if dist.get_rank() == 0:
                tiny_model(config).save_pretrained(root)
            dist.barrier()
            pipe = hs.from_pretrained(
                root, current_mesh(), n_microbatches=MICROBATCHES, schedule="1f1b", fully_shard=fully_shard
            )
            assert isinstance(pipe, hs.pipelining.Pipeline), type(pipe)
            report = pipe.hs_load_report
            names = {n for n, _ in pipe.named_parameters()}
            stage_1 = {n for n in expected.initial if n.startswith(STAGE_1)}
            mine = stage_1 if pipe.pp_rank == 1 else set(expected.initial) - stage_1
            assert names == mine and set(report.loaded) == mine, sorted(set(report.loaded) ^ mine)[:5]
            assert set(report.unused_keys) == set(expected.initial) - mine, report.unused_keys[:5]
            assert not report.initialized, report.initialized[:5]
            total = sum(t.numel() * 4 for t in expected.initial.values())  # float32 files
            stage_bytes = sum(expected.initial[n].numel() * 4 for n in mine)
            want = stage_bytes // 2 if fully_shard else stage_bytes
            assert report.bytes_read == report.local_bytes == want, (report.bytes_read, report.local_bytes, want)
            groups = [m for s in pipe.modules for m in s.modules() if hasattr(m, "_hs_fully_shard")]
            assert len(groups) == (3 if fully_shard else 0), len(groups)  # 2 layers and the root
            for name, p in pipe.named_parameters():
                assert isinstance(p, hs.DTensor), name
                assert torch.equal(_full(p), expected.initial[name]), name
            pipe.train()
            from test_pipelining import _only, _record  # noqa: PLC0415 -- the level1 folder is on sys.path

            got = _record(pipe, batches)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
        problems, worst = check_training(got, _only(expected, names))
        assert not problems, "\n".join(problems)
        _report(
            "from_pretrained_fully_shard" if fully_shard else "from_pretrained",
            "pp",
            expected.losses,
            got.losses,
            {**worst, "bytes_read": report.bytes_read, "model_bytes": total},
        )
        return torch.tensor(got.losses, dtype=torch.float64)

    return reference, distributed


def test_qwen3_from_pretrained_pp2_dp2_reads_only_its_stage_strict():
    cases = [
        _case("qwen3_from_pretrained_pp2_dp2", *from_pretrained_trainer()),
        _case("qwen3_from_pretrained_pp2_dp2_fully_shard", *from_pretrained_trainer(fully_shard=True)),
    ]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=400))
