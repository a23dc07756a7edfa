"""The training step of each implementation, shared by the step and memory sections: hypershard
(parallelize(), gradients bucketed or per parameter), torch DTensor tensor parallelism with data
parallelism by hand, and one device; plus what each rank holds in parameters, gradients and
optimizer states."""

from __future__ import annotations


def lr_at(step: int, total: int, base: float = 1e-3) -> float:
    """A learning rate that changes every step (a plan key must not depend on it)."""
    return base * (1.0 - 0.5 * step / max(total, 1))


def local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor as TorchDTensor

    import hypershard as hs

    if t is None:
        return 0
    if isinstance(t, hs.DTensor):
        t = hs._C.local_of(t)
    elif isinstance(t, TorchDTensor):
        t = t._local_tensor
    return t.numel() * t.element_size()


def state_bytes(params: list, optimizers: list) -> dict:
    import torch

    p = sum(local_bytes(x.detach()) for x in params)
    g = sum(local_bytes(x.grad) for x in params)
    o = 0
    for opt in optimizers:
        for state in opt.state.values():
            o += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params_mb": p / 2**20, "grads_mb": g / 2**20, "optimizer_mb": o / 2**20, "total_mb": (p + g + o) / 2**20}


class HypershardTrainer:
    def __init__(self, config, mesh_spec):
        import torch

        import hypershard as hs
        from hypershard.parallel import parallelize
        from hypershard.testing.models import tiny_model

        self.mesh = hs.init_device_mesh("cpu", *mesh_spec)
        self.model = parallelize(tiny_model(config), self.mesh)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01)
        self.optimizers = [self.optimizer]

    def step(self, ids, labels, lr: float) -> float:
        import torch

        loss = self.model(input_ids=ids, labels=labels).loss
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return float(loss.detach().item())


class HypershardPerParamTrainer(HypershardTrainer):
    """hypershard with each data-parallel gradient reduced in its own hook (bucket cap 0)."""

    def step(self, ids, labels, lr: float) -> float:
        import hypershard as hs

        saved = hs._C.grad_bucket_bytes()
        hs._C.set_grad_bucket_bytes(0)
        try:
            return super().step(ids, labels, lr)
        finally:
            hs._C.set_grad_bucket_bytes(saved)


class SingleTrainer:
    def __init__(self, config):
        import torch

        from hypershard.testing.models import tiny_model

        self.model = tiny_model(config)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01)
        self.optimizers = [self.optimizer]

    step = HypershardTrainer.step


class TorchTPTrainer:
    """The same training step with torch.distributed.tensor: parallelize_module with the
    equivalent of the model's HF plan on the tp sub-mesh (q/k/v/gate/up ColwiseParallel, o/down
    RowwiseParallel, lm_head ColwiseParallel gathering its output; embedding and norms plain and
    replicated), q_norm/k_norm gradients summed over tp (HF's replicated_with_grad_allreduce), the
    batch split over dp with every gradient summed over dp (the loss is divided by the GLOBAL
    number of label tokens, so the result equals one device), clip by the global norm, AdamW.
    Gradient sums run one all-reduce per parameter, or with `bucketed` one per dtype over the
    flattened gradients (what DDP's buckets do)."""

    def __init__(self, config, mesh_spec, bucketed: bool = False):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from hypershard.testing.models import tiny_model

        shape, names = mesh_spec
        self.mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        self.bucketed = bucketed
        tp_mesh = self.mesh["tp"]
        self.tp_group = tp_mesh.get_group()
        self.dp = shape[names.index("dp")] if "dp" in names else 1
        self.dp_group = self.mesh["dp"].get_group() if self.dp > 1 else None
        self.dp_rank = dist.get_rank(self.dp_group) if self.dp > 1 else 0
        model = tiny_model(config)
        plan: dict = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[prefix + name] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[prefix + name] = RowwiseParallel()
        self.model = parallelize_module(model, tp_mesh, plan)
        self.params = list(self.model.parameters())
        self.dtensor_params = [p for p in self.params if isinstance(p, DTensor)]
        self.plain_params = [p for p in self.params if not isinstance(p, DTensor)]
        self.tp_reduced = [
            p for n, p in self.model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))
        ]
        # torch's foreach kernels refuse lists mixing DTensors and plain tensors: one AdamW each
        self.optimizers = [
            torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01) for ps in (self.dtensor_params, self.plain_params) if ps
        ]

    def step(self, ids, labels, lr: float) -> float:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor as TorchDTensor

        local_ids = ids.chunk(self.dp)[self.dp_rank]
        local_labels = labels.chunk(self.dp)[self.dp_rank]
        items = int((labels[:, 1:] != -100).sum())  # HF shifts labels by one
        loss = self.model(input_ids=local_ids, labels=local_labels, num_items_in_batch=items).loss
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        self._sum_grads([p.grad for p in self.tp_reduced], self.tp_group)
        if self.dp > 1:
            self._sum_grads(
                [p.grad._local_tensor if isinstance(p.grad, TorchDTensor) else p.grad for p in self.params],
                self.dp_group,
            )
        # clip_grad_norm_(max_norm=1.0) over both lists with one global norm
        norms = []
        for grads in ([p.grad for p in self.dtensor_params], [p.grad for p in self.plain_params]):
            if grads:
                n = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
                norms.append(n.full_tensor() if isinstance(n, TorchDTensor) else n)
        total = torch.linalg.vector_norm(torch.stack(norms))
        coef = float(torch.clamp(1.0 / (total + 1e-6), max=1.0))
        for grads in ([p.grad for p in self.dtensor_params], [p.grad for p in self.plain_params]):
            if grads:
                torch._foreach_mul_(grads, coef)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        value = loss.detach().clone()
        if self.dp > 1:
            dist.all_reduce(value, group=self.dp_group)
        return float(value.item())

    def _sum_grads(self, grads: list, group) -> None:
        import torch
        import torch.distributed as dist

        if not self.bucketed:
            for g in grads:
                dist.all_reduce(g, group=group)
            return
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
