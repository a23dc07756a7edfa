"""Level1, strict mode: a run with hs.offload_optimizer checkpoints and resumes (issue 44).

Qwen3 (tiny) fully sharded over dp trains 2 AdamW steps (lr 1e-3, weight decay 0.01,
clip_grad_norm_ 1.0), hypershard.checkpoint.save writes model and optimizer, a fresh model (other
weights: the load must fill every one) loads it and trains step 3. Compared with 3 uninterrupted
one-device steps by hypershard.testing.training's checks (losses rtol 1e-5, first-step gradients
and final parameters in norm; the tolerances are argued there: only the order of float32 sums
differs between a sharded run and one device, and a checkpoint round trip moves no value -- DCP
writes and reads the float32 bytes, the step count is an exact float):

- dp4 with offload -> dp4 with offload: also BIT FOR BIT equal to the uninterrupted dp4 run with
  the plain AdamW (same mesh, same program: the same sums in the same order; the host AdamW is the
  same single-tensor kernel on the same values -- test_fully_shard's qwen3_dp4_optimizer_offload).
  The two saves, offloaded and plain, hold the same DCP entries (every parameter's exp_avg,
  exp_avg_sq, step under its name), the same chunks (each rank wrote its own shards) and the
  same bytes per rank's file: the offloaded state has the plain one's global layout.
- dp4 with offload -> dp2 x tp2 (tp plan, then fully_shard over dp) with the plain AdamW.
- dp2 x tp2 with the plain AdamW -> dp4 with offload.

Planted faults, on the first case, each must fail the one-device checks:
- the optimizer state not restored (load hands the optimizer an empty state: step 3 starts AdamW
  over, its update is about lr * sign(g), not the bias-corrected mean of three gradients);
- the host masters not re-read after the load (the fresh model's weights come back at step 3)."""

import torch

from hypershard.testing import Case, Input, assert_all_passed, current_mesh, run_cases

STEPS, SAVED_AT = 3, 2
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
DP4 = ((4,), ("dp",))


def _setup():
    from hypershard.testing.models import make_batches, tiny_config

    config = tiny_config("qwen3")
    return config, make_batches(config.vocab_size, STEPS, batch=4, seq=16)


class _Run:
    """A tiny Qwen3 fully sharded on `mesh_kind` ("dp4", or "dp2_tp2": parallelize's TP plan, then
    fully_shard over dp) with AdamW, on the host (`offload`) or not."""

    def __init__(self, mesh_kind, offload, config, seed):
        import hypershard as hs
        from hypershard.fsdp.fully_shard import fully_shard
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model

        mesh = current_mesh() if mesh_kind == "dp4" else hs.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
        model = parallelize(tiny_model(config, seed=seed), mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh)
        self.model = fully_shard(model, mesh)
        params = list(self.model.parameters())
        if offload:
            self.optimizer = hs.offload_optimizer(params, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def step(self, ids, labels, grads=None):
        """hypershard.testing.models.train's step."""
        from hypershard.testing.training import _full

        loss = self.model(input_ids=ids, labels=labels).loss
        self.optimizer.zero_grad()
        loss.backward()
        if grads is not None:
            grads.update({n: _full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None})
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        return float(loss.detach().item())

    def final(self):
        from hypershard.testing.training import _full

        return {n: _full(p) for n, p in self.model.named_parameters()}


def _shared_dir():
    import tempfile

    import torch.distributed as dist

    holder = [tempfile.mkdtemp(prefix="hs_offload_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _storage(path):
    """{DCP key: (global size, sorted chunks)} and {rank's .distcp file: bytes} of a checkpoint."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    entries = {}
    for key, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(meta, "chunks", []))
        entries[key] = (tuple(getattr(meta, "size", ())), chunks)
    files = {p.name: p.stat().st_size for p in Path(path).glob("*.distcp")}
    return entries, files


def _check_same_layout(offloaded, plain, names):
    """The offloaded save holds the plain one's entries, chunks and bytes per rank; the optimizer's
    state is every parameter's exp_avg, exp_avg_sq and step, its chunks tiling the tensor once."""
    import math

    got, got_files = _storage(offloaded)
    want, want_files = _storage(plain)
    assert got.keys() == want.keys(), f"DCP keys differ: {sorted(got.keys() ^ want.keys())[:6]}"
    differ = [k for k in got if got[k] != want[k]]
    assert not differ, f"chunks differ from the plain optimizer's: {[(k, got[k], want[k]) for k in differ[:3]]}"
    assert got_files == want_files, f"bytes per rank differ: {got_files} vs {want_files}"
    state = {k for k in got if k.startswith("optimizer.state.")}
    assert state == {f"optimizer.state.{n}.{s}" for n in names for s in ("exp_avg", "exp_avg_sq", "step")}, (
        sorted(state)[:6]
    )
    for key in state:
        size, chunks = got[key]
        assert sum(math.prod(c[1]) for c in chunks) == math.prod(size), f"{key}: chunks {chunks} do not tile {size}"


def _empty_optimizer_state(checkpoint_api):
    """Fault: load gives the optimizer its param groups but no per-parameter state."""
    original = checkpoint_api.set_optimizer_state_dict

    def set_state(model, optimizer, state):
        original(model, optimizer, {**state, "state": {}})

    checkpoint_api.set_optimizer_state_dict = set_state
    return lambda: setattr(checkpoint_api, "set_optimizer_state_dict", original)


def _masters_not_reread(_checkpoint_api):
    """Fault: the host masters keep the values of the model the optimizer was built on."""
    from hypershard.fsdp import offload

    original = offload.OffloadedOptimizer._read_masters
    offload.OffloadedOptimizer._read_masters = lambda self: None
    return lambda: setattr(offload.OffloadedOptimizer, "_read_masters", original)


FAULTS = {"state_not_restored": _empty_optimizer_state, "masters_not_reread": _masters_not_reread}


def resumes(first, then, fault=None):
    """`first`, `then`: (mesh kind, offload) of the run saved at step 2 and of the resumed one."""

    def reference(_dummy):
        from hypershard.testing.models import tiny_model, train

        config, batches = _setup()
        return torch.tensor(train(tiny_model(config), batches, lr=LR, clip=CLIP), dtype=torch.float64)

    def distributed(_dummy):
        import shutil

        import torch.distributed as dist

        import hypershard as hs
        from hypershard import checkpoint
        from hypershard.checkpoint import api as checkpoint_api
        from hypershard.testing.models import tiny_model
        from hypershard.testing.training import TrainingRecord, check_training, record_training

        config, batches = _setup()
        expected = record_training(tiny_model(config), batches)
        root = _shared_dir()
        try:
            with hs.strict():
                run = _Run(*first, config, seed=0)
                grads: dict = {}
                losses = [run.step(*batches[0], grads=grads), run.step(*batches[1])]
                path = checkpoint.save(f"{root}/run", run.model, run.optimizer, step=SAVED_AT)
                del run
                uninterrupted = None
                if first == then == ("dp4", True) and fault is None:
                    plain = _Run("dp4", False, config, seed=0)
                    plain_losses = [plain.step(*b) for b in batches[:SAVED_AT]]
                    plain_path = checkpoint.save(f"{root}/plain", plain.model, plain.optimizer, step=SAVED_AT)
                    plain_losses.append(plain.step(*batches[SAVED_AT]))
                    uninterrupted = (plain_losses, plain.final())
                    del plain
                    _check_same_layout(path, plain_path, [n for n, _ in tiny_model(config).named_parameters()])

                resumed = _Run(*then, config, seed=1)  # other weights: the load must fill every one
                undo = FAULTS[fault](checkpoint_api) if fault else None
                try:
                    checkpoint.load(path, resumed.model, resumed.optimizer)
                finally:
                    if undo is not None:
                        undo()
                losses.append(resumed.step(*batches[SAVED_AT]))
                got = TrainingRecord(losses=losses, first_grads=grads, final=resumed.final())
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
        problems, worst = check_training(got, expected)
        if fault:
            assert problems, f"planted fault {fault} was NOT caught; worst ratios {worst}"
            return torch.tensor(expected.losses, dtype=torch.float64)
        assert not problems, "\n".join(problems)
        if uninterrupted is not None:
            plain_losses, plain_final = uninterrupted
            assert losses == plain_losses, f"resumed {losses} vs uninterrupted {plain_losses}"
            differ = [n for n in plain_final if not torch.equal(got.final[n], plain_final[n])]
            assert not differ, f"not bit for bit the uninterrupted run's: {differ[:5]}"
        return torch.tensor(losses, dtype=torch.float64)

    return reference, distributed


def _case(name, reference, distributed):
    # The harness compares the returned losses with the reference's again (rtol 1e-5, the loss
    # tolerance of hypershard.testing.training); the planted cases return the reference's own.
    return Case(name, reference, [Input((1,), requires_grad=False)], DP4, dist_fn=distributed,
                check_grad=False, rtol=1e-5, atol=0.0)


def test_offloaded_optimizer_checkpoint_resumes_strict():
    offload_dp4, plain_tp = ("dp4", True), ("dp2_tp2", False)
    cases = [
        _case("qwen3_dp4_offload_to_dp4_offload", *resumes(offload_dp4, offload_dp4)),
        _case("qwen3_dp4_offload_to_dp2_tp2_plain", *resumes(offload_dp4, plain_tp)),
        _case("qwen3_dp2_tp2_plain_to_dp4_offload", *resumes(plain_tp, offload_dp4)),
        _case("qwen3_dp4_offload_planted_state_not_restored_is_caught",
              *resumes(offload_dp4, offload_dp4, fault="state_not_restored")),
        _case("qwen3_dp4_offload_planted_masters_not_reread_is_caught",
              *resumes(offload_dp4, offload_dp4, fault="masters_not_reread")),
    ]
    assert_all_passed(run_cases(cases, backend="hypershard", timeout=600))
